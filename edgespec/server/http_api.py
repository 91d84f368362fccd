"""The HTTP APIs (OpenAI's chat, completions and Responses; Anthropic's Messages): a Starlette
app, served by uvicorn in a thread of the daemon (edgespec/server/http_server.py).

Starlette + uvicorn rather than FastAPI: the routes validate their bodies themselves
(openai_api.py) so that a bad field is a 400 naming it in OpenAI's error shape, not pydantic's
422; what is left is routing, requests, streaming responses and an ASGI server, which Starlette
and uvicorn are (FastAPI would add pydantic models we would not use).

Both APIs share one engine: a request becomes an engine_loop.Job submitted to the daemon's
EngineLoop (same admission queue, metrics, deadlines and request-id logging as gRPC); a client
that disconnects cancels its job. Errors are domain exceptions mapped to HTTP codes in ONE place
(http_errors.py: `STATUS` / `error_response`), as status.py maps them to gRPC codes.

Routes: POST /v1/chat/completions, POST /v1/completions (unary, or server-sent events ending
`data: [DONE]` with stream: true), POST /v1/responses (OpenAI's Responses, stateless:
responses_api.py), POST /v1/messages and /v1/messages/count_tokens (Anthropic's: anthropic_api.py;
both translate to and from the chat pipeline), GET /v1/models, GET /health (200
only when SERVING), POST /tokenize, POST /detokenize. Every route but /health needs a token when
tokens are configured (the gRPC token files; `Authorization: Bearer` or `x-api-key`). A stream's
answer is a sequence of typed events (answer.py) each API formats its own way.

The rooms: this module routes, and wraps every route in its request id, auth and error mapping;
http_chat.py holds the generating routes, http_jobs.py runs their engine jobs, http_stream.py
writes a streamed answer, models_api.py the /v1/models, embeddings and rerank routes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgespec import chat as chat_encoding
from edgespec.errors import BadRequest, UnknownModel
from edgespec.logs import bind_request_id, clear_request, get_logger
from edgespec.server import embeddings as emb
from edgespec.server import models_api, origin, pipe
from edgespec.server import openai_api as oa
from edgespec.server.auth import TokenAuth
from edgespec.server.callers import CallerLimits
from edgespec.server.config import LimitsConfig
from edgespec.server.engine_loop import EngineLoop
from edgespec.server.http_chat import ChatRoutes
from edgespec.server.http_errors import (
    RETRY_AFTER_SECONDS,
    PayloadTooLarge,
    Shape,
    Unauthenticated,
    anthropic_error,
    error_response,
)
from edgespec.server.http_jobs import HttpJobs
from edgespec.server.policy import Policy

log = get_logger("edgespec.server.http_api")

AUTH_METHOD = "/edgespec.v1.Inference/HTTP"  # what TokenAuth.check sees for an HTTP route


class HttpApi:
    """The routes, over the daemon's engine loop, policy and auth: the generating ones in
    ChatRoutes, the side models' in models_api.ModelRoutes; health, metrics and tokens here."""

    def __init__(self, loop: EngineLoop, policy: Callable[[], Policy], auth: Callable[[], TokenAuth], *,
                 model_id: str, created: int, max_body_bytes: int, threads: int, n_ctx: int,
                 limits: LimitsConfig | None = None, chat_template: str = "",
                 embedder: emb.Embedder | None = None, strict: bool = False, callers: CallerLimits | None = None,
                 tool_format: str = "auto", reasoning_format: str = "auto",
                 metrics: Callable[[str | None, bool], tuple[bytes, str]] | None = None,
                 registry: models_api.Registry | None = None, reranker: Any = None,
                 record: Callable[[str, str, int, float], None] | None = None):
        self.loop = loop
        # the served models by name and role (models_api.py): /v1/models, and what `model` routes to
        self.registry = registry or models_api.build_registry(model_id, embedder.cfg if embedder else None,
                                                              created=created)
        # Accept header -> (exposition, content type) ([metrics] enabled), served at /metrics under the API's auth
        self.metrics = metrics
        self.n_ctx = n_ctx
        self.limits = limits or LimitsConfig()
        self.auth = auth
        self.model_id = model_id
        self.max_body_bytes = max_body_bytes
        self.jobs = HttpJobs(loop, threads=threads, chat_template=chat_template, callers=callers)
        self.chat_routes = ChatRoutes(self.jobs, self.registry, policy, model_id=model_id, limits=self.limits,
                                      strict=strict, read_json=self._json, tool_format=tool_format,
                                      reasoning_format=reasoning_format)
        self.model_routes = models_api.ModelRoutes(
            self.registry, reranker=reranker, max_prompt_bytes=self.limits.max_prompt_bytes, read_json=self._json,
            run=self.jobs.run, admit=self.jobs.admit_now, record=record, embedder=embedder)
        self.app = Starlette(routes=self._routes(), exception_handlers={HTTPException: self._http_exception})

    def _routes(self) -> list[Route]:
        chat, models = self.chat_routes, self.model_routes
        rerank = self._endpoint(models.rerank)
        return [
            Route("/v1/chat/completions", self._endpoint(chat.chat), methods=["POST"]),
            Route("/v1/completions", self._endpoint(chat.completions), methods=["POST"]),
            Route("/v1/models", self._endpoint(models.models), methods=["GET"]),
            *[Route(path, rerank, methods=["POST"]) for path in ("/v1/rerank", "/rerank", "/v2/rerank")],
            Route("/v1/messages", self._endpoint(chat.messages, shape=anthropic_error), methods=["POST"]),
            Route("/v1/messages/count_tokens", self._endpoint(chat.count_tokens, shape=anthropic_error),
                  methods=["POST"]),
            Route("/v1/responses", self._endpoint(chat.responses), methods=["POST"]),
            Route("/v1/embeddings", self._endpoint(models.embeddings), methods=["POST"]),
            *([Route("/metrics", self._endpoint(self.metrics_text, open_=True), methods=["GET"])]
              if self.metrics else []),
            Route("/health", self._endpoint(self.health, open_=True), methods=["GET"]),
            Route("/tokenize", self._endpoint(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._endpoint(self.detokenize), methods=["POST"]),
        ]

    # ---- plumbing ------------------------------------------------------------------------------

    def _endpoint(self, fn: Callable, open_: bool = False, shape: Shape | None = None) -> Callable:
        """Request id, auth and error mapping around a route (`shape`: the API's own error body
        from the status and OpenAI's; None: OpenAI's). A token comes as `Authorization: Bearer`
        or as `x-api-key` (Anthropic's header): the same tokens, the same identities."""
        async def handle(request: Request) -> Response:
            clear_request()
            started = time.monotonic()
            caller_rid = request.headers.get("x-request-id", "")
            rid = uuid.uuid4().hex[:16]
            client = request.client
            peer = f"{'ipv6' if client and ':' in client.host else 'ipv4'}:{client.host}:{client.port}" \
                if client else "unknown"
            bind_request_id(request_id=rid, peer=peer)
            decision = decide(self.auth(), request)
            bind_request_id(caller=decision.identity)
            try:
                caller_rid = pipe.request_id(caller_rid, "x-request-id")  # as over gRPC: refused by name
                if caller_rid:
                    rid = caller_rid  # the job takes the caller's id
                    bind_request_id(request_id=rid, x_request_id=caller_rid)
                if not self.auth().enabled:  # no token: browsers on this host are held to their origin
                    origin.check(request.headers, request.url.scheme, client.host if client else None)
                if not open_ and decision.verdict is not None:
                    raise Unauthenticated("missing or invalid bearer token (header 'Authorization: Bearer <token>' "
                                          "or 'x-api-key: <token>') or client certificate")
                resp = await fn(request, rid)
            except Exception as exc:  # mapped in one place
                resp = error_response(exc, request.url.path, shape)
            resp.headers["x-request-id"] = rid
            # the access line, as gRPC's `rpc` line: peer, caller, x_request_id bound above (a stream's
            # status is its first line's; how the stream ended is in the generation's own lines)
            level = log.debug if request.url.path == "/health" else log.info
            level("http", method=request.method, path=request.url.path, status=resp.status_code,
                  seconds=round(time.monotonic() - started, 6))
            return resp

        return handle

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        body = oa.error_body(f"{request.method} {request.url.path}: {exc.detail}", type_, code=code)
        if request.url.path.startswith("/v1/messages"):
            body = anthropic_error(exc.status_code, body)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def _json(self, request: Request) -> Any:
        size = 0
        parts = []
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                raise PayloadTooLarge("body", f"larger than {self.max_body_bytes} bytes (server.max_message_bytes)")
            parts.append(part)
        try:
            return json.loads(b"".join(parts))
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest("body", f"is not valid JSON: {exc}") from None
        except RecursionError:
            raise BadRequest("body", "is nested too deeply") from None

    # ---- the rest ------------------------------------------------------------------------------

    async def metrics_text(self, request: Request, rid: str) -> Response:
        """A metrics or admin token's scrape (TokenAuth.scrape); the per-caller figures for admin."""
        assert self.metrics is not None
        scope = self.auth().scrape(request.headers.get("authorization"), client_subject(request.scope))
        if scope is None:
            raise Unauthenticated("/metrics needs a metrics token (auth.metrics_tokens_file) or an admin token "
                                  "or certificate")
        body, content_type = self.metrics(request.headers.get("accept"), scope == "all")
        return Response(body, headers={"content-type": content_type})

    async def health(self, request: Request, rid: str) -> Response:
        if self.loop.ready:
            return JSONResponse({"status": "SERVING"})
        state = "DRAINING" if self.loop.draining else "NOT_SERVING"
        return JSONResponse({"status": state}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    async def tokenize(self, request: Request, rid: str) -> Response:
        body = await self._json(request)
        if not isinstance(body, dict):
            raise BadRequest("body", "must be a JSON object")
        for k in body:
            if k not in ("model", "prompt", "messages", "add_special_tokens"):
                raise BadRequest(k, "unknown field (known: model, prompt, messages, add_special_tokens)")
        if body.get("model") not in (None, self.model_id):
            raise UnknownModel("model", f"unknown model {body['model']!r} (served: {self.model_id})")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise BadRequest("add_special_tokens", f"must be true or false, got {add_special!r}")
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise BadRequest("prompt", "set exactly one of prompt or messages")
        if body.get("messages") is not None:
            messages = oa._messages(body["messages"], self.limits)
            text = ""
        else:
            messages = ()
            text = oa._str(body["prompt"], "prompt")
            n = len(text.encode("utf-8"))
            if n > self.limits.max_prompt_bytes:
                raise BadRequest("prompt", f"at most {self.limits.max_prompt_bytes} bytes (limits.max_prompt_bytes), "
                                           f"got {n}")

        def encode(tok: Any) -> list[int]:
            return chat_encoding.encode_prompt(tok, text, messages, add_special=add_special)

        enc = self.loop.encoder
        if enc is not None:
            ids = await self.jobs.run(encode, enc)
        else:  # an engine without an encoder: on its own thread, the engine itself the tokenizer
            ids = await self.jobs.call(encode)
        return JSONResponse({"tokens": list(ids), "count": len(ids), "max_model_len": self.n_ctx})

    async def detokenize(self, request: Request, rid: str) -> Response:
        body = await self._json(request)
        if not isinstance(body, dict):
            raise BadRequest("body", "must be a JSON object")
        for k in body:
            if k not in ("model", "tokens"):
                raise BadRequest(k, "unknown field (known: model, tokens)")
        if body.get("model") not in (None, self.model_id):
            raise UnknownModel("model", f"unknown model {body['model']!r} (served: {self.model_id})")
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise BadRequest("tokens", "must be a list of token ids")
        pieces = await self.jobs.vocabulary()
        for i, t in enumerate(tokens):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < len(pieces):
                raise BadRequest(f"tokens[{i}]", f"must be a token id in [0, {len(pieces) - 1}], got {t!r}")
        text = b"".join(pieces[t] for t in tokens).decode("utf-8", errors="replace")
        return JSONResponse({"prompt": text})


def decide(auth: Any, request: Request) -> Any:
    """The token check of an HTTP request: its `Authorization: Bearer` token, or its `x-api-key`
    (Anthropic's header) as one, or its client certificate's subject (TokenAuth.decide)."""
    key = request.headers.get("x-api-key")
    authorization = request.headers.get("authorization") or (f"Bearer {key}" if key else None)
    return auth.decide(AUTH_METHOD, authorization, client_subject(request.scope))


def client_subject(scope: dict) -> tuple[str, str] | None:
    """The verified client certificate's (subject, common name) from the ASGI TLS extension
    (scope["extensions"]["tls"], filled by http_server.PeerCertificates under mutual TLS), or None."""
    return scope.get("extensions", {}).get("tls", {}).get("client_subject")


__all__: Sequence[str] = ("AUTH_METHOD", "HttpApi", "client_subject", "decide")
