"""The ONE place where errors become gRPC status codes, plus auth and the access log, as a server
interceptor that wraps every handler. Domain exceptions are raised anywhere below; this maps them.
Anything unexpected is INTERNAL with the request id, logged with its traceback; the daemon stays up.

Every RPC ends with one `rpc` log line carrying the peer address, the caller's identity (a token's
name or a client certificate's subject, never a secret), the caller's `x-request-id` (echoed back
in trailing metadata) and the status code; every other line logged while handling it carries the
same fields (structlog contextvars)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import structlog

from edgespec.errors import BadRequest, Cancelled, ConfigError, EdgespecError, ModelError, NotReady, Overloaded
from edgespec.logs import bind_request_id, clear_request, get_logger
from edgespec.server.auth import TokenAuth

log = get_logger("edgespec.server")


class DeadlineExceeded(EdgespecError):
    """The caller's deadline passed before generation finished."""


# most specific first
STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
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
    context.abort(code, message)



def _is_abort(exc: BaseException, context: grpc.ServicerContext) -> bool:
    """context.abort() raises a bare Exception after setting the code: let it through."""
    code = getattr(context, "code", lambda: None)()
    return type(exc) is Exception and code is not None


def _caller_request_id(md: dict) -> str:
    """The caller's x-request-id, checked like GenerateRequest.request_id."""
    rid = str(md.get("x-request-id") or "")
    if len(rid) > 128 or any(not (c.isascii() and (c.isalnum() or c in "-_.:")) for c in rid):
        raise BadRequest("x-request-id", "at most 128 characters of [A-Za-z0-9-_.:]")
    return rid


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


class ServerInterceptor(grpc.ServerInterceptor):
    """Auth, error mapping and the access log for every RPC. `auth` may be replaced while serving
    (a reload): each RPC reads it once, when it starts."""

    def __init__(self, auth: TokenAuth | None = None):
        self.auth = auth or TokenAuth()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        kind = ("stream" if handler.request_streaming else "unary") + "_" + ("stream" if handler.response_streaming else "unary")
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        ser = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
        fn = getattr(handler, kind)
        if handler.response_streaming:
            def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                started = self._begin(context, method)
                try:
                    yield from fn(request, context)
                except Exception as exc:  # noqa: BLE001 - mapped below
                    if _is_abort(exc, context):
                        raise
                    _abort(context, exc, method)
                finally:
                    _end(context, method, started)

            return make(stream, **ser)

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            started = self._begin(context, method)
            try:
                return fn(request, context)
            except Exception as exc:  # noqa: BLE001 - mapped below
                if _is_abort(exc, context):
                    raise
                _abort(context, exc, method)
            finally:
                _end(context, method, started)

        return make(unary, **ser)

    def _begin(self, context: grpc.ServicerContext, method: str) -> float:
        """Bind the RPC's log fields, echo the caller's request id, check the credentials (an
        RPC that fails them is aborted here)."""
        clear_request()  # handler threads are pooled: drop the previous RPC's bindings
        started = time.monotonic()
        md = dict(context.invocation_metadata() or ())
        bind_request_id(request_id=uuid.uuid4().hex[:16], peer=context.peer())
        decision = self.auth.decide(method, md.get("authorization"), _subject(context))
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


def _end(context: grpc.ServicerContext, method: str, started: float, code: grpc.StatusCode | None = None) -> None:
    """The access log line: one per RPC (health checks at debug level)."""
    code = code or getattr(context, "code", lambda: None)() or grpc.StatusCode.OK
    if not isinstance(code, grpc.StatusCode):  # some grpcio versions report the raw value
        code = next((c for c in grpc.StatusCode if code in (c.value[0], c.value)), grpc.StatusCode.UNKNOWN)
    level = log.debug if method.startswith("/grpc.health.v1.Health/") else log.info
    level("rpc", method=method, code=code.name, seconds=round(time.monotonic() - started, 6))
