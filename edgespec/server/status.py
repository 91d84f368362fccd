"""The ONE place where errors become gRPC status codes, plus bearer-token auth, as a server
interceptor that wraps every handler. Domain exceptions are raised anywhere below; this maps them.
Anything unexpected is INTERNAL with the request id, logged with its traceback; the daemon stays up.

Two defences against callers without a token live here too, since only this layer sees a call
before its handler runs:
- health calls without a valid token (health is open by design) are *anonymous*: at most
  `anonymous_rpcs` of them at once, Watch streams included, served by a thread pool of their own;
  past that they are refused with RESOURCE_EXHAUSTED at once. Authorised work keeps every thread
  and concurrency slot it had, whatever anonymous callers hold.
- refused calls (no token, wrong token, not an admin) are answered without waiting for their
  request message, so a caller who never sends one holds nothing.
A request whose bytes do not decode (invalid UTF-8 in a string field) is INVALID_ARGUMENT naming
the field (edgespec.server.wire), logged, instead of grpc's unlogged INTERNAL."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import structlog

from edgespec.errors import BadRequest, Cancelled, ConfigError, EdgespecError, ModelError, NotReady, Overloaded
from edgespec.logs import bind_request_id, clear_request, get_logger
from edgespec.server.auth import OPEN_SERVICES, TokenAuth
from edgespec.server.wire import bad_utf8_field

log = get_logger("edgespec.server")

# a method no token-less caller may call: "does this token pass here" = "is it a valid token"
_TOKEN_PROBE = "/edgespec.v1.Inference/Generate"


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
        except Exception as exc:  # noqa: BLE001 - every decode failure is the caller's
            return Undecodable(deserializer, data, exc)

    return parse


def _checked(request: Any) -> Any:
    if isinstance(request, Undecodable):
        raise request.bad_request()
    return request


def _begin(context: grpc.ServicerContext) -> None:
    clear_request()  # handler threads are pooled: drop the previous RPC's bindings
    md = dict(context.invocation_metadata() or ())
    bind_request_id(request_id=str(md.get("x-request-id") or uuid.uuid4().hex[:16]))


def _wrap_unary(fn: Callable, method: str) -> Callable:
    def behavior(request: Any, context: grpc.ServicerContext) -> Any:
        _begin(context)
        try:
            return fn(_checked(request), context)
        except Exception as exc:  # noqa: BLE001 - mapped below
            if _is_abort(exc, context):
                raise
            _abort(context, exc, method)

    return behavior


def _wrap_stream(fn: Callable, method: str) -> Callable:
    def behavior(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        _begin(context)
        try:
            yield from fn(_checked(request), context)
        except Exception as exc:  # noqa: BLE001 - mapped below
            if _is_abort(exc, context):
                raise
            _abort(context, exc, method)

    return behavior


def _is_abort(exc: BaseException, context: grpc.ServicerContext) -> bool:
    """context.abort() raises a bare Exception after setting the code: let it through."""
    code = getattr(context, "code", lambda: None)()
    return type(exc) is Exception and code is not None


def _denied(code: grpc.StatusCode, message: str, streaming_response: bool, **ser: Any) -> grpc.RpcMethodHandler:
    """A handler that refuses at once. Request-streaming, whatever the method: grpc then calls it
    without first waiting for the request message, which a hostile caller may never send."""
    if streaming_response:
        def stream(_requests: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            context.abort(code, message)
            yield  # pragma: no cover

        return grpc.stream_stream_rpc_method_handler(stream, **ser)

    def unary(_requests: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    return grpc.stream_unary_rpc_method_handler(unary, **ser)


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
    """Auth (every RPC but health, when tokens are configured), the anonymous-call cap and error
    mapping for every RPC."""

    def __init__(self, auth: TokenAuth | None = None, anonymous_rpcs: int = 8):
        self.auth = auth or TokenAuth()
        self.anonymous = _Slots(anonymous_rpcs)
        # anonymous calls run here, never on the server's pool; a few spare threads cover a call
        # that has given its slot back but not yet returned its thread
        self.anonymous_pool = futures.ThreadPoolExecutor(max_workers=anonymous_rpcs + 2,
                                                         thread_name_prefix="edgespec-anon")

    def close(self) -> None:
        self.anonymous_pool.shutdown(wait=False, cancel_futures=True)

    def _has_valid_token(self, authorization: str | None) -> bool:
        return self.auth.enabled and self.auth.check(_TOKEN_PROBE, authorization) is None

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        md = dict(details.invocation_metadata or ())
        authorization = md.get("authorization")
        verdict = self.auth.check(method, authorization)
        kind = ("stream" if handler.request_streaming else "unary") + "_" + ("stream" if handler.response_streaming else "unary")
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        ser = {"request_deserializer": lenient(handler.request_deserializer),
               "response_serializer": handler.response_serializer}
        if verdict is not None:
            code = grpc.StatusCode.UNAUTHENTICATED if verdict == "unauthenticated" else grpc.StatusCode.PERMISSION_DENIED
            message = ("missing or invalid bearer token (metadata 'authorization: Bearer <token>')"
                       if verdict == "unauthenticated" else "this RPC needs an admin token")
            log.warning("rpc_denied", method=method, code=code.name)
            return _denied(code, message, handler.response_streaming, **ser)
        if handler.request_streaming:  # reflection: nothing of ours to map
            return handler
        service = method.lstrip("/").split("/", 1)[0]
        if service in OPEN_SERVICES and not self._has_valid_token(authorization):
            return self._anonymous(handler, kind, method, ser)
        fn = getattr(handler, kind)
        wrapped = _wrap_stream(fn, method) if handler.response_streaming else _wrap_unary(fn, method)
        return make(wrapped, **ser)

    def _anonymous(self, handler: grpc.RpcMethodHandler, kind: str, method: str, ser: dict) -> grpc.RpcMethodHandler:
        """A health call without a valid token: a slot of `anonymous_rpcs` (taken here, on the
        server's one serving thread, so a refusal needs no thread of the anonymous pool) for as
        long as the call lives, given back by grpc's termination callback whatever ends it."""
        if not self.anonymous.take():
            log.warning("rpc_refused", method=method, reason="limits.anonymous_rpcs", limit=self.anonymous.capacity)
            return _denied(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"too many calls without a token at once (limits.anonymous_rpcs = "
                           f"{self.anonymous.capacity}); retry later, or send a bearer token",
                           handler.response_streaming, **ser)
        give = self.anonymous.give_back_once()
        fn = getattr(handler, kind)

        def first(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            """The one request message (read here: the slot bounds a caller who never sends it)."""
            _begin(context)
            if not context.add_callback(give):
                give()  # already over
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
                try:
                    request = first(requests, context)
                except EdgespecError as exc:
                    _abort(context, exc, method)
                    return iter(())
                return fn(request, context)  # the servicer's own iterator (Watch): no generator of ours

            stream.experimental_thread_pool = self.anonymous_pool  # type: ignore[attr-defined]
            return grpc.stream_stream_rpc_method_handler(stream, **ser)

        def unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            try:
                return fn(first(requests, context), context)
            except Exception as exc:  # noqa: BLE001 - mapped below
                if _is_abort(exc, context):
                    raise
                _abort(context, exc, method)

        unary.experimental_thread_pool = self.anonymous_pool  # type: ignore[attr-defined]
        return grpc.stream_unary_rpc_method_handler(unary, **ser)
