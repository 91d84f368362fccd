"""Requests to the chat model they name: each chat model has its own HTTP app (an HttpApi over
its engine) and its own gRPC servicer; these route a request to the one its `model` names (the
default model for an empty or unknown name, whose API then answers as it always has), holding
the model loaded while the request runs (chat_models.ChatModels.use): a model not loaded is
loaded first, within the request's deadline.

HTTP: the generation routes' bodies are read here (up to the API's body limit) to find `model`
and `edgespec.timeout_seconds`, then handed on unchanged. A caller the API would refuse (no
valid token, a foreign browser origin) is handed on at once: it never makes a model load."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import anyio

from edgespec.errors import EdgespecError
from edgespec.proto.edgespec.v1 import inference_pb2_grpc
from edgespec.server.chat_models import ChatModel, ChatModels

ASGIApp = Callable[[dict, Callable, Callable], Any]
ROUTED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                    "/v1/responses", "/tokenize", "/detokenize"})


def body_model(body: bytes) -> tuple[str, float | None]:
    """A JSON body's `model` ("" when absent or not a string) and `edgespec.timeout_seconds`."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "", None
    if not isinstance(doc, dict):
        return "", None
    model = doc.get("model")
    ext = doc.get("edgespec")
    timeout = ext.get("timeout_seconds") if isinstance(ext, dict) else None
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        timeout = None
    return (model if isinstance(model, str) else ""), (float(timeout) if timeout is not None else None)


class ModelDispatch:
    """The ASGI app in front of the chat models' HTTP apps (`apps`: name -> ASGI app, the default
    model's first). `admitted(scope)`: whether the API would let this caller in."""

    def __init__(self, models: ChatModels, apps: Mapping[str, ASGIApp], *, max_body_bytes: int,
                 admitted: Callable[[dict], bool], error: Callable[[BaseException, str], Any]):
        self.models, self.apps = models, apps
        self.default = apps[models.default.name]
        self.max_body_bytes = max_body_bytes
        self.admitted, self.error = admitted, error

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("path") not in ROUTED or scope.get("method") != "POST":
            await self.default(scope, receive, send)
            return
        parts: list[dict] = []
        size, more = 0, True
        while more and size <= self.max_body_bytes:
            msg = await receive()
            parts.append(msg)
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            more = msg.get("more_body", False)
        replay = _Replay(parts, receive)
        if more or size > self.max_body_bytes or not self.admitted(scope):
            await self.default(scope, replay, send)  # it answers: too large, unauthorised
            return
        name, timeout = body_model(b"".join(p.get("body", b"") for p in parts if p["type"] == "http.request"))
        model = self.models.find(name)
        deadline = time.monotonic() + timeout if timeout is not None else None
        held = threading.Event()

        def hold() -> None:
            self.models.acquire(model, deadline)
            held.set()

        try:  # a cancel (the client gone) waits for the thread: `held` then says what to give back
            await anyio.to_thread.run_sync(hold)
        except EdgespecError as exc:
            await self.error(exc, scope.get("path", ""))(scope, replay, send)
            return
        except BaseException:
            if held.is_set():
                self.models.release(model)
            raise
        try:
            await self.apps[model.name](scope, replay, send)
        finally:
            self.models.release(model)


def admitted(auth: Callable[[], Any], scope: dict) -> bool:
    """Whether the HTTP API lets this request's caller in (its token, or with no tokens configured
    its browser origin): http_api's own checks, made before a model is loaded on its behalf."""
    from starlette.requests import Request

    from edgespec.server import origin
    from edgespec.server.http_api import decide

    request = Request(scope)
    now = auth()
    if decide(now, request).verdict is not None:
        return False
    if not now.enabled:
        try:
            origin.check(request.headers, request.url.scheme, request.client.host if request.client else None)
        except EdgespecError:
            return False
    return True


def error_app(exc: BaseException, path: str) -> Any:
    """The HTTP API's own error answer (status and body shape) for `exc` on `path`."""
    from edgespec.server.http_errors import anthropic_error, error_response

    return error_response(exc, path, anthropic_error if path.startswith("/v1/messages") else None)


class _Replay:
    """An ASGI receive that gives the messages already read, then the connection's own."""

    def __init__(self, parts: list[dict], receive: Callable):
        self.parts, self.receive = list(parts), receive

    async def __call__(self) -> dict:
        if self.parts:
            return self.parts.pop(0)
        return await self.receive()


class RoutingServicer(inference_pb2_grpc.InferenceServicer):
    """Inference's RPCs over the chat models' servicers (`servicers`: name -> InferenceServicer,
    the default model's first): Generate, GenerateStream, Tokenize and ModelInfo go to the model
    their `model` names (an unknown name: NOT_FOUND listing the served ones; another role's:
    INVALID_ARGUMENT); Embed, Rerank and ListModels to the default's (they name their own)."""

    def __init__(self, models: ChatModels, servicers: Mapping[str, Any], registry: Any):
        self.models, self.servicers, self.registry = models, servicers, registry
        self.default = servicers[models.default.name]

    def _pick(self, name: str) -> tuple[ChatModel, Any]:
        model = self.models.find(self.registry.pick("chat", name).id if name else "")
        return model, self.servicers[model.name]

    @staticmethod
    def _deadline(context: Any) -> float | None:
        remaining = context.time_remaining()
        return time.monotonic() + remaining if remaining is not None and remaining < 1e8 else None

    def Generate(self, request: Any, context: Any) -> Any:
        model, servicer = self._pick(request.model)
        with self.models.use(model, self._deadline(context)):
            return servicer.Generate(request, context)

    def GenerateStream(self, request: Any, context: Any) -> Iterator[Any]:
        model, servicer = self._pick(request.model)
        with self.models.use(model, self._deadline(context)):
            yield from servicer.GenerateStream(request, context)

    def Tokenize(self, request: Any, context: Any) -> Any:
        model, servicer = self._pick(request.model)
        with self.models.use(model, self._deadline(context)):
            return servicer.Tokenize(request, context)

    def ModelInfo(self, request: Any, context: Any) -> Any:
        model, servicer = self._pick(request.model)
        with self.models.use(model, self._deadline(context)):
            return servicer.ModelInfo(request, context)

    def Embed(self, request: Any, context: Any) -> Any:
        return self.default.Embed(request, context)

    def Rerank(self, request: Any, context: Any) -> Any:
        return self.default.Rerank(request, context)

    def ListModels(self, request: Any, context: Any) -> Any:
        return self.default.ListModels(request, context)
