"""The HTTP API's open connections, bounded: idle and slow-header sockets cannot starve it.

uvicorn counts open connections against its `limit_concurrency` and gives a connection all the
time it likes to send its first request's headers, so a few dozen sockets that connect and say
nothing made every request (/health included) answer 503. Here, instead:

- a connection must bring a request's headers within `header_timeout` seconds of opening, and the
  next one's within as long of its last request's end; else it is closed;
- at most `max_connections` are open; one more closes the oldest connection with no request in
  flight (an idle or slow-header one), so a flood of idle sockets never locks a client out;
- at most `max_requests` requests are in flight (uvicorn's cap, now counting requests, not
  sockets); beyond them a request is answered 503 with Retry-After, /health excepted.

Two halves, joined by the peer address as PeerCertificates does (http_server.py): a protocol
factory around uvicorn's protocol (connection opened, lost, timed out) and an ASGI middleware (a
request's headers are in: the app is called; the request is over: it returns).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any, cast

from edgespec.logs import get_logger

log = get_logger("edgespec.server.connections")

RETRY_AFTER_SECONDS = 1
OPEN_PATHS = ("/health",)  # answered beyond max_requests: the liveness probe must not see the load


def _peer_key(address: Any) -> tuple[str, int] | None:
    return (str(address[0]), int(address[1])) if isinstance(address, (tuple, list)) and len(address) >= 2 else None


class _Connection:
    __slots__ = ("transport", "opened", "in_flight", "timer")

    def __init__(self, transport: asyncio.Transport):
        self.transport = transport
        self.opened = time.monotonic()
        self.in_flight = 0
        self.timer: asyncio.TimerHandle | None = None


class ConnectionGuard:
    """The open connections of one HTTP listener (used from its event loop's thread only)."""

    def __init__(self, header_timeout: float, max_connections: int, max_requests: int):
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.max_requests = max_requests
        self._open: dict[tuple[str, int], _Connection] = {}  # by peer address, oldest first
        self.in_flight = 0
        self.stats = {"timed_out": 0, "evicted": 0, "refused": 0, "overloaded": 0}

    def __len__(self) -> int:
        return len(self._open)

    # -- the protocol side ---------------------------------------------------------------------
    def _arm(self, conn: _Connection) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
        conn.timer = asyncio.get_running_loop().call_later(self.header_timeout, self._expire, conn)

    def _expire(self, conn: _Connection) -> None:
        conn.timer = None
        if conn.in_flight == 0:
            self.stats["timed_out"] += 1
            conn.transport.abort()

    def _admit(self, key: tuple[str, int], transport: asyncio.Transport) -> bool:
        if len(self._open) >= self.max_connections:
            idle = next((c for c in self._open.values() if c.in_flight == 0), None)
            if idle is None:  # every connection is serving a request: this one waits its turn
                self.stats["refused"] += 1
                return False
            self.stats["evicted"] += 1
            self._forget(next(k for k, c in self._open.items() if c is idle))
            idle.transport.abort()
        conn = _Connection(transport)
        self._open[key] = conn
        self._arm(conn)
        return True

    def _forget(self, key: tuple[str, int]) -> None:
        conn = self._open.pop(key, None)
        if conn is not None and conn.timer is not None:
            conn.timer.cancel()

    def protocol(self, inner: Callable[..., asyncio.Protocol]) -> Callable[..., asyncio.Protocol]:
        """A protocol factory for uvicorn's `http=`: `inner` (built with uvicorn's arguments)
        behind a plain asyncio.Protocol that admits, times and forgets the connection."""
        guard = self

        class Guarded(asyncio.Protocol):
            alpn_protocols = getattr(inner, "alpn_protocols", None)

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.inner = inner(*args, **kwargs)
                self.key: tuple[str, int] | None = None
                self.admitted = False

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                transport = cast(asyncio.Transport, transport)  # a TCP server's connection
                self.key = _peer_key(transport.get_extra_info("peername"))
                if self.key is not None and not guard._admit(self.key, transport):
                    transport.abort()
                    return
                self.admitted = True
                self.inner.connection_made(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                if self.key is not None and self.admitted:
                    conn = guard._open.get(self.key)
                    if conn is not None:
                        guard._forget(self.key)
                if self.admitted:
                    self.inner.connection_lost(exc)

            def data_received(self, data: bytes) -> None:
                if self.admitted:
                    self.inner.data_received(data)

            def eof_received(self) -> bool | None:
                return self.inner.eof_received() if self.admitted else None

            def pause_writing(self) -> None:
                self.inner.pause_writing()

            def resume_writing(self) -> None:
                self.inner.resume_writing()

        return Guarded

    # -- the ASGI side ------------------------------------------------------------------------
    def app(self, app: Callable) -> Callable:
        """ASGI middleware: a request in flight holds its connection open (no header timeout) and
        counts against max_requests; its end re-arms the timeout for the next request's headers."""
        async def guarded(scope: dict, receive: Callable, send: Callable) -> None:
            if scope.get("type") != "http":
                await app(scope, receive, send)
                return
            if self.in_flight >= self.max_requests and scope.get("path") not in OPEN_PATHS:
                self.stats["overloaded"] += 1
                await _unavailable(send)
                return
            key = _peer_key(scope.get("client"))
            conn = self._open.get(key) if key is not None else None
            if conn is not None:
                conn.in_flight += 1
                if conn.timer is not None:
                    conn.timer.cancel()
                    conn.timer = None
            self.in_flight += 1
            try:
                await app(scope, receive, send)
            finally:
                self.in_flight -= 1
                if conn is not None:
                    conn.in_flight -= 1
                    if conn.in_flight == 0 and key is not None and self._open.get(key) is conn:
                        self._arm(conn)

        return guarded


async def _unavailable(send: Callable) -> None:
    body = json.dumps({"error": {"message": "too many requests in flight; retry", "type": "service_unavailable_error",
                                 "param": None, "code": "overloaded"}}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(RETRY_AFTER_SECONDS).encode())]})
    await send({"type": "http.response.body", "body": body})
