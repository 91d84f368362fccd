"""The ONE place where errors become gRPC status codes, plus bearer-token auth, as a server
interceptor that wraps every handler. Domain exceptions are raised anywhere below; this maps them.
Anything unexpected is INTERNAL with the request id, logged with its traceback; the daemon stays up."""

from __future__ import annotations

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


def _begin(context: grpc.ServicerContext) -> None:
    clear_request()  # handler threads are pooled: drop the previous RPC's bindings
    md = dict(context.invocation_metadata() or ())
    bind_request_id(request_id=str(md.get("x-request-id") or uuid.uuid4().hex[:16]))


def _wrap_unary(fn: Callable, method: str) -> Callable:
    def behavior(request: Any, context: grpc.ServicerContext) -> Any:
        _begin(context)
        try:
            return fn(request, context)
        except Exception as exc:  # noqa: BLE001 - mapped below
            if _is_abort(exc, context):
                raise
            _abort(context, exc, method)

    return behavior


def _wrap_stream(fn: Callable, method: str) -> Callable:
    def behavior(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        _begin(context)
        try:
            yield from fn(request, context)
        except Exception as exc:  # noqa: BLE001 - mapped below
            if _is_abort(exc, context):
                raise
            _abort(context, exc, method)

    return behavior


def _is_abort(exc: BaseException, context: grpc.ServicerContext) -> bool:
    """context.abort() raises a bare Exception after setting the code: let it through."""
    code = getattr(context, "code", lambda: None)()
    return type(exc) is Exception and code is not None


def _denied(code: grpc.StatusCode, message: str, streaming_response: bool) -> Callable:
    if streaming_response:
        def stream(_request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            context.abort(code, message)
            yield  # pragma: no cover

        return stream

    def unary(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    return unary


class ServerInterceptor(grpc.ServerInterceptor):
    """Auth (every RPC but health, when tokens are configured) and error mapping for every RPC."""

    def __init__(self, auth: TokenAuth | None = None):
        self.auth = auth or TokenAuth()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        md = dict(details.invocation_metadata or ())
        verdict = self.auth.check(method, md.get("authorization"))
        kind = ("stream" if handler.request_streaming else "unary") + "_" + ("stream" if handler.response_streaming else "unary")
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        ser = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
        if verdict is not None:
            code = grpc.StatusCode.UNAUTHENTICATED if verdict == "unauthenticated" else grpc.StatusCode.PERMISSION_DENIED
            message = ("missing or invalid bearer token (metadata 'authorization: Bearer <token>')"
                       if verdict == "unauthenticated" else "this RPC needs an admin token")
            log.warning("rpc_denied", method=method, code=code.name)
            return make(_denied(code, message, handler.response_streaming), **ser)
        if handler.request_streaming:  # reflection: nothing of ours to map
            return handler
        fn = getattr(handler, kind)
        wrapped = _wrap_stream(fn, method) if handler.response_streaming else _wrap_unary(fn, method)
        return make(wrapped, **ser)
