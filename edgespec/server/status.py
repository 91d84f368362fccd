"""The ONE place where errors become gRPC status codes, plus auth and the access log, as a server
interceptor that wraps every handler (reflection included). Domain exceptions are raised anywhere
below; this maps them. Anything unexpected is INTERNAL with the request id, logged with its
traceback; the daemon stays up.

Every RPC ends with one `rpc` log line carrying the peer address, the caller's identity (a token's
name or a client certificate's subject, never a secret), the caller's `x-request-id` (echoed back
in trailing metadata) and the status code; every other line logged while handling it carries the
same fields (structlog contextvars).

Two defences against callers without a token live here too, since only this layer sees a call
before its handler runs:
- health calls without a valid token or certificate (health is open by design) are *anonymous*:
  at most `anonymous_rpcs` of them at once, Watch streams included, served by a thread pool of
  their own; past that they are refused with RESOURCE_EXHAUSTED at once. Authorised work keeps
  every thread and concurrency slot it had, whatever anonymous callers hold.
- refused calls (no token, wrong token, not an admin) are answered without waiting for their
  request message, so a caller who never sends one holds nothing.
Both are decided from the call's metadata, before grpc reads a request. Only a call without a
token under mutual TLS needs its certificate's subject, which grpc shows inside the handler: that
caller has passed the TLS handshake with a certificate the client CA signed (no anonymous caller),
and is decided there, as every RPC's identity is bound there.
A request whose bytes do not decode (invalid UTF-8 in a string field) is INVALID_ARGUMENT naming
the field (edgespec.server.wire), logged, instead of grpc's unlogged INTERNAL."""

from __future__ import annotations

import contextlib
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import structlog

from edgespec.errors import (
    BadRequest,
    Cancelled,
    ConfigError,
    DeadlineExceeded,
    EdgespecError,
    ModelError,
    NotReady,
    Overloaded,
    UnknownModel,
)
from edgespec.logs import bind_request_id, clear_request, get_logger
from edgespec.server import pipe
from edgespec.server.auth import OPEN_SERVICES, Decision, TokenAuth
from edgespec.server.wire import bad_utf8_field

log = get_logger("edgespec.server")


# most specific first
STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnknownModel, grpc.StatusCode.NOT_FOUND),
    (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotReady, grpc.StatusCode.UNAVAILABLE),
    (Cancelled, grpc.StatusCode.CANCELLED),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ModelError, grpc.StatusCode.INTERNAL),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for kind, code in STATUS:
        if isinstance(exc, kind):
            if code is grpc.StatusCode.INTERNAL:
                break
            return code, str(exc)
    rid = structlog.contextvars.get_contextvars().get("request_id", "-")
    return grpc.StatusCode.INTERNAL, f"internal error (request id {rid})"


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("rpc_failed", method=method, error=repr(exc), exc_info=exc)
    else:
        log.info("rpc_rejected", method=method, code=code.name, detail=message)
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:  # gRPC's retry throttling reads this (a caller over its own limit)
        rid = structlog.contextvars.get_contextvars().get("x_request_id")
        context.set_trailing_metadata((("grpc-retry-pushback-ms", str(math.ceil(retry_after * 1000))),
                                       *((("x-request-id", rid),) if rid else ())))
    context.abort(code, message)


def _is_abort(exc: BaseException, context: grpc.ServicerContext) -> bool:
    """context.abort() raises a bare Exception after setting the code: let it through."""
    code = getattr(context, "code", lambda: None)()
    return type(exc) is Exception and code is not None


# ---- undecodable requests -------------------------------------------------------------------


class Undecodable:
    """What a request deserializer returns instead of raising (grpc would answer INTERNAL,
    unlogged): the handler wrapper turns it into BadRequest naming the field."""

    def __init__(self, deserializer: Callable, data: bytes, error: Exception):
        self.error = error
        desc = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
        self.type = desc.full_name if desc is not None else "request"
        self.field = bad_utf8_field(desc, data) if desc is not None else None

    def bad_request(self) -> BadRequest:
        if self.field:
            return BadRequest(self.field, "is not valid UTF-8 (string fields must be)")
        return BadRequest("request", f"is not a valid {self.type} message: {self.error}")


def lenient(deserializer: Callable | None) -> Callable | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # every decode failure is the caller's
            return Undecodable(deserializer, data, exc)

    return parse


def _checked(request: Any) -> Any:
    if isinstance(request, Undecodable):
        raise request.bad_request()
    return request


# ---- identity and the access log ------------------------------------------------------------


def _caller_request_id(md: dict) -> str:
    """The caller's x-request-id, checked like GenerateRequest.request_id."""
    return pipe.request_id(str(md.get("x-request-id") or ""), "x-request-id")


def _subject(context: grpc.ServicerContext) -> tuple[str, str] | None:
    """(subject, common name) of the client certificate grpc verified, or None."""
    ac = context.auth_context() or {}
    if b"ssl" not in ac.get("transport_security_type", ()):
        return None
    full = b"".join(ac.get("x509_subject", ())[:1]).decode("utf-8", "replace")
    cn = b"".join(ac.get("x509_common_name", ())[:1]).decode("utf-8", "replace")
    return (full, cn) if (full or cn) else None


DENIED = {
    "unauthenticated": (grpc.StatusCode.UNAUTHENTICATED,
                        "missing or invalid credentials (metadata 'authorization: Bearer <token>', or a client certificate)"),
    "permission_denied": (grpc.StatusCode.PERMISSION_DENIED,
                          "this RPC needs an admin token or a certificate subject in auth.admin_subjects"),
}


def _begin(context: grpc.ServicerContext, method: str, auth: TokenAuth, decision: Decision | None) -> float:
    """Bind the RPC's log fields, echo the caller's request id, apply the credentials' decision
    (`None`: decide here, with the client certificate); an RPC they refuse is aborted here, after
    its access log line."""
    clear_request()  # handler threads are pooled: drop the previous RPC's bindings
    started = time.monotonic()
    md = dict(context.invocation_metadata() or ())
    bind_request_id(request_id=uuid.uuid4().hex[:16], peer=context.peer())
    if decision is None:
        decision = auth.decide(method, md.get("authorization"), _subject(context))
    bind_request_id(caller=decision.identity)
    try:
        caller_rid = _caller_request_id(md)
    except BadRequest as exc:
        _end(context, method, started, grpc.StatusCode.INVALID_ARGUMENT)
        _abort(context, exc, method)
    if caller_rid:
        bind_request_id(x_request_id=caller_rid)
        context.set_trailing_metadata((("x-request-id", caller_rid),))
    if decision.verdict is not None:
        code, message = DENIED[decision.verdict]
        log.warning("rpc_denied", method=method, code=code.name)
        _end(context, method, started, code)
        context.abort(code, message)
    return started


def _end(context: grpc.ServicerContext, method: str, started: float, code: grpc.StatusCode | None = None,
         fields: dict | None = None) -> None:
    """The access log line: one per RPC (health checks at debug level). `fields`: the RPC's bound
    log fields, for a line written from grpc's termination callback (another thread)."""
    code = code or getattr(context, "code", lambda: None)() or grpc.StatusCode.OK
    if not isinstance(code, grpc.StatusCode):  # some grpcio versions report the raw value
        code = next((c for c in grpc.StatusCode if code in (c.value[0], c.value)), grpc.StatusCode.UNKNOWN)
    level = log.debug if method.startswith("/grpc.health.v1.Health/") else log.info
    level("rpc", **(fields or {}), method=method, code=code.name, seconds=round(time.monotonic() - started, 6))


# ---- handlers ---------------------------------------------------------------------------------


def _denied(method: str, auth: TokenAuth, decision: Decision, streaming_response: bool, *,
            refusal: tuple[grpc.StatusCode, str] | None = None, **ser: Any) -> grpc.RpcMethodHandler:
    """A handler that refuses at once (the decision's verdict, or `refusal`), after the access log
    line. Request-streaming, whatever the method: grpc then calls it without first waiting for the
    request message, which a hostile caller may never send."""

    def refuse(context: grpc.ServicerContext) -> None:
        started = _begin(context, method, auth, decision)  # aborts for a refused decision
        if refusal is not None:
            _end(context, method, started, refusal[0])
            context.abort(*refusal)

    if streaming_response:
        def stream(_requests: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            refuse(context)
            yield  # pragma: no cover

        return grpc.stream_stream_rpc_method_handler(stream, **ser)

    def unary(_requests: Any, context: grpc.ServicerContext) -> Any:
        refuse(context)

    return grpc.stream_unary_rpc_method_handler(unary, **ser)


def _wrapped(handler: grpc.RpcMethodHandler, kind: str, method: str, auth: TokenAuth,
             decision: Decision | None, ser: dict) -> grpc.RpcMethodHandler:
    """Any handler kind with auth (`decision`, or decided inside with the certificate), error
    mapping and the access log; a request-streaming one (reflection) gets its messages as they
    come."""
    fn = getattr(handler, kind)
    make = getattr(grpc, f"{kind}_rpc_method_handler")
    arg = (lambda r: r) if handler.request_streaming else _checked
    if handler.response_streaming:
        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with _handled(context, method, auth, decision):
                yield from fn(arg(request), context)

        return make(stream, **ser)

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        with _handled(context, method, auth, decision):
            return fn(arg(request), context)

    return make(unary, **ser)


@contextlib.contextmanager
def _handled(context: grpc.ServicerContext, method: str, auth: TokenAuth, decision: Decision | None) -> Iterator[None]:
    """Around a handler's body: credentials first (_begin), an error mapped to its status code
    (an abort already raised passes through), the access log line last."""
    started = _begin(context, method, auth, decision)
    try:
        yield
    except Exception as exc:  # mapped below
        if _is_abort(exc, context):
            raise
        _abort(context, exc, method)
    finally:
        _end(context, method, started)


class _Slots:
    """A counter of calls in flight, taken without blocking, given back exactly once per call."""

    def __init__(self, n: int):
        self.capacity = n
        self._free = n
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self._free <= 0:
                return False
            self._free -= 1
            return True

    def give_back_once(self) -> Callable[[], None]:
        done = threading.Event()

        def give() -> None:
            with self._lock:
                if done.is_set():
                    return
                done.set()
                self._free += 1

        return give

    @property
    def in_use(self) -> int:
        with self._lock:
            return self.capacity - self._free


class ServerInterceptor(grpc.ServerInterceptor):
    """Auth, the anonymous-call cap, error mapping and the access log for every RPC. `auth` may be
    replaced while serving (a reload): each RPC reads it once, when it starts."""

    def __init__(self, auth: TokenAuth | None = None, anonymous_rpcs: int = 8):
        self.auth = auth or TokenAuth()
        self.anonymous = _Slots(anonymous_rpcs)
        # anonymous calls run here, never on the server's pool; a few spare threads cover a call
        # that has given its slot back but not yet returned its thread
        self.anonymous_pool = futures.ThreadPoolExecutor(max_workers=anonymous_rpcs + 2,
                                                         thread_name_prefix="edgespec-anon")

    def close(self) -> None:
        self.anonymous_pool.shutdown(wait=False, cancel_futures=True)

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        auth = self.auth  # one reading per RPC
        authorization = dict(details.invocation_metadata or ()).get("authorization")
        kind = ("stream" if handler.request_streaming else "unary") + "_" + ("stream" if handler.response_streaming else "unary")
        # a request-streaming handler (reflection) reads its own messages: grpc's deserializer
        deserializer = handler.request_deserializer if handler.request_streaming else lenient(handler.request_deserializer)
        ser = {"request_deserializer": deserializer, "response_serializer": handler.response_serializer}
        # decided here, before grpc waits for a request message, unless only the certificate can tell
        decision = None if auth.needs_subject(authorization) else auth.decide(method, authorization)
        if decision is not None and decision.verdict is not None:
            return _denied(method, auth, decision, handler.response_streaming, **ser)
        service = method.lstrip("/").split("/", 1)[0]
        if (decision is not None and not decision.identified and service in OPEN_SERVICES
                and not handler.request_streaming):
            return self._anonymous(handler, kind, method, auth, decision, ser)
        return _wrapped(handler, kind, method, auth, decision, ser)

    def _anonymous(self, handler: grpc.RpcMethodHandler, kind: str, method: str, auth: TokenAuth,
                   decision: Decision, ser: dict) -> grpc.RpcMethodHandler:
        """A health call without a valid token: a slot of `anonymous_rpcs` (taken here, on the
        server's one serving thread, so a refusal needs no thread of the anonymous pool) for as
        long as the call lives, given back by grpc's termination callback whatever ends it."""
        if not self.anonymous.take():
            log.warning("rpc_refused", method=method, reason="limits.anonymous_rpcs", limit=self.anonymous.capacity)
            return _denied(method, auth, decision, handler.response_streaming,
                           refusal=(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"too many calls without a token at once (limits.anonymous_rpcs = "
                                    f"{self.anonymous.capacity}); retry later, or send a bearer token"), **ser)
        give = self.anonymous.give_back_once()
        fn = getattr(handler, kind)

        def hold(context: grpc.ServicerContext) -> None:
            """The slot goes back when the call ends, whatever ends it."""
            if not context.add_callback(give):
                give()  # already over

        def first(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            """The one request message (read here: the slot bounds a caller who never sends it)."""
            try:
                return _checked(next(requests))
            except StopIteration:
                raise BadRequest("request", "exactly one request message is required") from None
            except EdgespecError:
                raise
            except Exception:
                if not context.is_active():
                    raise Cancelled("the caller went away before sending its request") from None
                raise

        if handler.response_streaming:
            def stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                hold(context)
                started = _begin(context, method, auth, decision)
                try:
                    request = first(requests, context)
                except EdgespecError as exc:
                    _end(context, method, started, status_for(exc)[0])
                    _abort(context, exc, method)
                    return iter(())
                # the access line when the stream ends, whatever ends it (on grpc's callback thread)
                fields = structlog.contextvars.get_contextvars()
                if not context.add_callback(lambda: _end(context, method, started, fields=fields)):
                    _end(context, method, started)
                return fn(request, context)  # the servicer's own iterator (Watch): no generator of ours

            stream.experimental_thread_pool = self.anonymous_pool  # type: ignore[attr-defined]
            return grpc.stream_stream_rpc_method_handler(stream, **ser)

        def unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            hold(context)
            with _handled(context, method, auth, decision):
                return fn(first(requests, context), context)

        unary.experimental_thread_pool = self.anonymous_pool  # type: ignore[attr-defined]
        return grpc.stream_unary_rpc_method_handler(unary, **ser)
