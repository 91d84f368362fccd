"""Idle and slow-header socket floods against a listener on loopback, and timed checks that
real clients are still served while they are open (tests/server/test_connections.py, the
end-to-end tests/server/test_tenants_e2e.py)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator

from edgespec.bench.flood_probe import PARTIAL  # what a slow-header client sent when it stopped


@contextlib.contextmanager
def flood(port: int, idle: int, slow: int, kind: str = "http") -> Iterator[list[socket.socket]]:
    """`idle` sockets that connect and say nothing and `slow` that send part of a request, held
    open for the body of the `with`; closed after it."""
    socks: list[socket.socket] = []
    try:
        for i in range(idle + slow):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i >= idle:
                with contextlib.suppress(OSError):  # the server may already have closed it
                    s.sendall(PARTIAL[kind])
            socks.append(s)
        yield socks
    finally:
        for s in socks:
            s.close()


def timed(check: Callable[[], object]) -> tuple[float, object]:
    """(seconds, result) of one call."""
    t0 = time.monotonic()
    out = check()
    return time.monotonic() - t0, out


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (waits on the socket, not a sleep)."""
    sock.settimeout(seconds)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
