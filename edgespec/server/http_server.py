"""The HTTP API's server: uvicorn serving http_api.HttpApi's Starlette app in a thread of the
daemon (start, graceful stop, the HTTPS certificate's reload on SIGHUP), and the client
certificate of a mutual-TLS connection handed to the app as the ASGI TLS extension.

uvicorn does not implement the ASGI TLS extension (`scope["extensions"]["tls"]`; its pull
requests for it are open), and no public option of its passes the peer certificate on. What it
does take is a protocol factory (`Config(http=...)`): `PeerCertificates.protocol` wraps the
h11 protocol uvicorn names "h11" in a plain asyncio.Protocol that, when a connection is made,
records the transport's verified certificate (`get_extra_info("peercert")`, public asyncio) by
the peer's address, and forgets it when the connection is lost; `PeerCertificates.app`, an ASGI
middleware, writes the extension into each request's scope from the address the scope names
(`scope["client"]`). Neither side touches uvicorn's internals, and an app reading the standard
extension keeps working when uvicorn (or another server) fills it itself.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.config import HTTP_PROTOCOLS, create_ssl_context
from uvicorn.importer import import_from_string

from edgespec.errors import ConfigError
from edgespec.logs import get_logger
from edgespec.server import embeddings as emb
from edgespec.server.auth import TokenAuth
from edgespec.server.callers import CallerLimits
from edgespec.server.config import DaemonConfig
from edgespec.server.connections import ConnectionGuard
from edgespec.server.engine_loop import EngineLoop
from edgespec.server.http_api import HttpApi
from edgespec.server.policy import Policy

log = get_logger("edgespec.server.http_server")

# RFC 4514 short names of the attributes a client certificate's subject usually carries
_RDN = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU", "countryName": "C",
        "stateOrProvinceName": "ST", "localityName": "L", "emailAddress": "emailAddress"}
# TLS versions as the ASGI TLS extension writes them (the protocol's own numbers)
_TLS_VERSIONS = {"TLSv1": 0x0301, "TLSv1.1": 0x0302, "TLSv1.2": 0x0303, "TLSv1.3": 0x0304}


def rdn_escape(value: str) -> str:
    """An attribute value escaped as RFC 4514 (and grpc's x509_subject, OpenSSL's RFC 2253 form)
    writes it: `,+"\\<>;` and NUL, a leading `#` or space and a trailing space, backslashed. Without
    it a CN of "ops,O=site" reads as the subject "CN=ops,O=site"."""
    out = [f"\\{c}" if c in ',+"\\<>;' else "\\00" if c == "\0" else c for c in value]
    if value[:1] in ("#", " "):
        out[0] = "\\" + out[0]
    if len(value) > 1 and value.endswith(" "):
        out[-1] = "\\ "
    return "".join(out)


def cert_subject(peercert: dict | None) -> tuple[str, str] | None:
    """(subject, common name) of a verified peer certificate (ssl's getpeercert() dict), the
    subject written as gRPC writes it (most specific first: "CN=x,O=y"), or None."""
    if not peercert or not peercert.get("subject"):
        return None
    pairs = [(k, v) for rdn in peercert["subject"] for k, v in rdn]
    full = ",".join(f"{_RDN.get(k, k)}={rdn_escape(v)}" for k, v in reversed(pairs))
    cn = next((v for k, v in pairs if k == "commonName"), "")
    return full, cn


def tls_extension(transport: asyncio.BaseTransport) -> dict[str, Any] | None:
    """The ASGI TLS extension's entry for a connection with a verified client certificate (None
    without one), plus `client_subject`: cert_subject's (subject, common name), the identity."""
    subject = cert_subject(transport.get_extra_info("peercert"))
    ssl_object = transport.get_extra_info("ssl_object")
    if subject is None or ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    return {"server_cert": None, "client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)] if der else [],
            "client_cert_name": subject[0], "client_cert_error": None,
            "tls_version": _TLS_VERSIONS.get(ssl_object.version() or ""), "cipher_suite": None,
            "client_subject": subject}


def _peer_key(address: Any) -> tuple[str, int] | None:
    """(host, port) of a socket address (IPv6's flow info and scope id dropped), as ASGI's
    scope["client"] writes it."""
    return (str(address[0]), int(address[1])) if isinstance(address, (tuple, list)) and len(address) >= 2 else None


class PeerCertificates:
    """Each open mutual-TLS connection's client certificate, by peer address: recorded by the
    protocol factory, read by the ASGI middleware."""

    def __init__(self) -> None:
        self._by_peer: dict[tuple[str, int], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def protocol(self, inner: type[asyncio.Protocol]) -> Callable[..., asyncio.Protocol]:
        """A protocol factory for uvicorn's `http=`: `inner` (built with uvicorn's arguments) behind
        a plain asyncio.Protocol that records the connection's certificate."""
        peers = self

        class Recording(asyncio.Protocol):
            alpn_protocols = getattr(inner, "alpn_protocols", None)  # what uvicorn offers in the handshake

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.inner = inner(*args, **kwargs)
                self.key: tuple[str, int] | None = None
                self.entry: dict[str, Any] | None = None

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.entry = tls_extension(transport)
                self.key = _peer_key(transport.get_extra_info("peername"))
                if self.entry is not None and self.key is not None:
                    with peers._lock:
                        peers._by_peer[self.key] = self.entry
                self.inner.connection_made(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                if self.key is not None:
                    with peers._lock:
                        if peers._by_peer.get(self.key) is self.entry:
                            del peers._by_peer[self.key]
                self.inner.connection_lost(exc)

            def data_received(self, data: bytes) -> None:
                self.inner.data_received(data)

            def eof_received(self) -> bool | None:
                return self.inner.eof_received()

            def pause_writing(self) -> None:
                self.inner.pause_writing()

            def resume_writing(self) -> None:
                self.inner.resume_writing()

        return Recording

    def app(self, app: Callable) -> Callable:
        """ASGI middleware: a request of a recorded connection gets `scope["extensions"]["tls"]`."""
        async def with_tls(scope: dict, receive: Callable, send: Callable) -> None:
            if scope.get("type") in ("http", "websocket"):
                key = _peer_key(scope.get("client"))
                with self._lock:
                    entry = self._by_peer.get(key) if key is not None else None
                if entry is not None:
                    scope.setdefault("extensions", {})["tls"] = entry
            await app(scope, receive, send)

        return with_tls


class HttpServer:
    """uvicorn serving HttpApi in its own thread; bound synchronously in start() (so a busy port
    is a ConfigError at start-up), stopped with stop(grace): no new connections, in-flight
    requests and streams get `grace` seconds, then their tasks are cancelled (which cancels the
    jobs)."""

    def __init__(self, cfg: DaemonConfig, loop: EngineLoop, policy: Callable[[], Policy],
                 auth: Callable[[], TokenAuth], embedder: emb.Embedder | None = None,
                 callers: CallerLimits | None = None,
                 metrics: Callable[[str | None, bool], tuple[bytes, str]] | None = None,
                 registry: Any = None, reranker: Any = None,
                 record: Callable[[str, str, int, float], None] | None = None,
                 chat: tuple[Any, Callable[[str], Callable[[], Policy]]] | None = None):
        """`chat`: (chat_models.ChatModels, name -> its policy) when the daemon serves several
        chat models: an HttpApi each, behind chat_routing.ModelDispatch."""
        self.cfg = cfg
        s = cfg.server
        workers = s.parallel + s.queue_size + 32  # as the gRPC server's handler threads
        shared = dict(auth=auth, max_body_bytes=s.max_message_bytes, threads=workers, limits=cfg.limits,
                      embedder=embedder, strict=cfg.http.strict, callers=callers, metrics=metrics,
                      registry=registry, reranker=reranker, record=record)
        target = Path(cfg.engine.target.path)
        self.api = HttpApi(loop, policy, model_id=target.name.removesuffix(".gguf"), created=_created(target),
                           n_ctx=cfg.engine.target.n_ctx, chat_template=cfg.chat_template,
                           tool_format=cfg.tool_format, reasoning_format=cfg.reasoning_format, **shared)
        self.app: Callable = self.api.app
        if chat is not None:
            from edgespec.server import chat_routing

            models, policy_of = chat
            apps = {models.default.name: self.api.app}
            for m in models.models[1:]:
                e = m.entry
                apps[m.name] = HttpApi(m, policy_of(m.name), model_id=m.name, created=_created(Path(e.engine.target.path)),
                                       n_ctx=e.engine.target.n_ctx, chat_template=e.chat_template,
                                       tool_format=e.tool_format, reasoning_format=e.reasoning_format, **shared).app
            self.app = chat_routing.ModelDispatch(models, apps, max_body_bytes=s.max_message_bytes,
                                                  admitted=lambda scope: chat_routing.admitted(auth, scope),
                                                  error=chat_routing.error_app)
        self._workers = workers
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._ssl: ssl.SSLContext | None = None  # the context uvicorn serves from
        self._current: ssl.SSLContext | None = None  # the one handshakes get (reload_tls rebuilds it)
        self._ssl_config: uvicorn.Config | None = None
        self.port = 0

    @property
    def scheme(self) -> str:
        return "https" if self.cfg.tls.enabled else "http"

    def _keep_ssl(self, config: uvicorn.Config, default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        """uvicorn's ssl_context_factory: its own context from the configured files. Each handshake
        is handed the context in force (`_current`, rebuilt by reload_tls) from the SNI callback,
        which OpenSSL calls for every ClientHello, with or without a server name."""
        self._ssl_config = config
        self._ssl = self._current = default()

        def current(sslobj: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
            if self._current is not self._ssl:
                sslobj.context = self._current  # its certificate, key and client CAs

        self._ssl.sni_callback = current
        return self._ssl

    def start(self) -> int:
        h, t = self.cfg.http, self.cfg.tls
        family = socket.AF_INET6 if ":" in h.host else socket.AF_INET
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so; without it the
        # response's header and body writes met Nagle and delayed ACKs (+40 ms a request)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((h.host.strip("[]"), h.port))
        except OSError as exc:
            sock.close()
            raise ConfigError("http.port", f"cannot listen on {h.host}:{h.port}: {exc}") from None
        sock.listen(max(128, min(h.max_connections, 4096)))
        sock.set_inheritable(True)
        self._sock = sock
        self.port = sock.getsockname()[1]
        # idle and slow-header connections are timed out and never hold a request's place
        # (edgespec/server/connections.py); uvicorn's own cap counted them
        self.guard = ConnectionGuard(h.header_timeout_seconds, h.max_connections, self._workers)
        app: Callable = self.guard.app(self.app)
        protocol = import_from_string(HTTP_PROTOCOLS["h11"])
        tls: dict[str, Any] = {}
        if t.enabled:
            tls = {"ssl_certfile": str(Path(t.cert).expanduser()), "ssl_keyfile": str(Path(t.key).expanduser()),
                   "ssl_context_factory": self._keep_ssl}
            if t.client_ca:
                peers = PeerCertificates()
                app = peers.app(app)
                tls.update(ssl_ca_certs=str(Path(t.client_ca).expanduser()), ssl_cert_reqs=ssl.CERT_REQUIRED)
                protocol = peers.protocol(protocol)
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", server_header=False,
            http=self.guard.protocol(protocol), limit_concurrency=None,
            timeout_graceful_shutdown=self.cfg.server.grace_seconds, timeout_keep_alive=5,
            backlog=max(128, min(h.max_connections, 4096)), **tls)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="edgespec-http", daemon=True)
        self._thread.start()
        log.info("http_listening", address=f"{self.scheme}://{format_host(h.host)}:{self.port}")
        return self.port

    def reload_tls(self, t: Any) -> None:
        """SIGHUP: a new SSL context from the certificate, key and client CAs as the files now
        hold them, handed to every new handshake (connections already open keep theirs). Rebuilt,
        not added to: a CA removed from tls.client_ca no longer verifies anyone. ssl.SSLError /
        OSError for a bad pair (the daemon's reload then changes nothing)."""
        c = self._ssl_config
        if self._ssl is None or c is None:
            return
        ca = str(Path(t.client_ca).expanduser()) if t.client_ca else None
        self._current = create_ssl_context(
            str(Path(t.cert).expanduser()), str(Path(t.key).expanduser()), None, c.ssl_version,
            ssl.CERT_REQUIRED if ca else ssl.CERT_NONE, ca, c.ssl_ciphers)

    def stop(self, grace: float | None = None) -> None:
        """Begin the graceful stop (returns at once); join() waits for it."""
        if self._server is not None:
            if grace is not None:
                self._server.config.timeout_graceful_shutdown = grace
            self._server.should_exit = True

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(5)
        if self._sock is not None:
            self._sock.close()


def _created(path: Path) -> int:
    """A model's `created` in /v1/models: its file's modification time."""
    try:
        return int(path.stat().st_mtime)
    except OSError:
        return 0


def format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def http_address(host: str, port: int) -> str:
    return f"{format_host(host)}:{port}"
