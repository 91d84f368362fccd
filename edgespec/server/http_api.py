"""The HTTP APIs (OpenAI's chat, completions and Responses; Anthropic's Messages): a Starlette
app, served by uvicorn in a thread of the daemon (edgespec/server/http_server.py).

Starlette + uvicorn rather than FastAPI: the routes validate their bodies themselves
(openai_api.py) so that a bad field is a 400 naming it in OpenAI's error shape, not pydantic's
422; what is left is routing, requests, streaming responses and an ASGI server, which Starlette
and uvicorn are (FastAPI would add pydantic models we would not use).

Both APIs share one engine: a request becomes an engine_loop.Job submitted to the daemon's
EngineLoop (same admission queue, metrics, deadlines and request-id logging as gRPC); a client
that disconnects cancels its job. Errors are domain exceptions mapped to HTTP codes in ONE place
(`STATUS` / `error_response`), as status.py maps them to gRPC codes.

Routes: POST /v1/chat/completions, POST /v1/completions (unary, or server-sent events ending
`data: [DONE]` with stream: true), POST /v1/responses (OpenAI's Responses, stateless:
responses_api.py), POST /v1/messages and /v1/messages/count_tokens (Anthropic's: anthropic_api.py;
both translate to and from the chat pipeline), GET /v1/models, GET /health (200
only when SERVING), POST /tokenize, POST /detokenize. Every route but /health needs a token when
tokens are configured (the gRPC token files; `Authorization: Bearer` or `x-api-key`). A stream's
answer is a sequence of typed events (answer.py) each API formats its own way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgespec import chat as chat_encoding
from edgespec import reasoning
from edgespec import tools as tools_mod
from edgespec.errors import (
    BadRequest,
    Cancelled,
    ConfigError,
    DeadlineExceeded,
    EdgespecError,
    NotReady,
    Overloaded,
    UnknownModel,
)
from edgespec.logs import bind_request_id, clear_request, get_logger
from edgespec.server import answer, convert, models_api, origin, pipe
from edgespec.server import anthropic_api as an
from edgespec.server import embeddings as emb
from edgespec.server import openai_api as oa
from edgespec.server import responses_api as ra
from edgespec.server.auth import TokenAuth
from edgespec.server.callers import UNLIMITED, CallerLimits, Place, Unlimited, current_caller, retry_after_seconds
from edgespec.server.config import LimitsConfig
from edgespec.server.engine_loop import EngineLoop, Job
from edgespec.server.origin import CrossSite
from edgespec.server.policy import Policy
from edgespec.types import Chunk, GenerationResult

log = get_logger("edgespec.server.http_api")

POLL_SECONDS = pipe.POLL_SECONDS  # how often a waiting request looks whether the engine is still there
KEEPALIVE_SECONDS = 5.0  # a stream silent this long (queued, or reading a long prompt) sends a keep-alive
OPEN_WAIT_SECONDS = 1.0  # a stream's status line waits this long at most for its jobs to be opened
RETRY_AFTER_SECONDS = 1
AUTH_METHOD = "/edgespec.v1.Inference/HTTP"  # what TokenAuth.check sees for an HTTP route


class Unauthenticated(EdgespecError):
    """Missing or unknown bearer token."""


class PayloadTooLarge(BadRequest):
    """The request body is larger than server.max_message_bytes."""


# ---- the ONE place where errors become HTTP codes (most specific first) ----------------------

STATUS: tuple[tuple[type[BaseException], int, str], ...] = (
    (PayloadTooLarge, 413, "invalid_request_error"),
    (UnknownModel, 404, "invalid_request_error"),
    (BadRequest, 400, "invalid_request_error"),
    (ConfigError, 400, "invalid_request_error"),
    (Unauthenticated, 401, "authentication_error"),
    (CrossSite, 403, "permission_error"),
    (Overloaded, 429, "rate_limit_error"),
    (NotReady, 503, "service_unavailable_error"),
    (Cancelled, 499, "cancelled"),
    (DeadlineExceeded, 504, "timeout_error"),
)
CODES = {401: "invalid_api_key", 404: "model_not_found", 413: "request_too_large", 429: "overloaded",
         503: "not_ready", 504: "deadline_exceeded"}


def error_status(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, OpenAI-style error body) for any exception; unexpected ones are 500 with the
    request id (and logged with their traceback by the caller)."""
    for kind, status, type_ in STATUS:
        if isinstance(exc, kind):
            param = getattr(exc, "field", None) if isinstance(exc, BadRequest) else None
            param = getattr(exc, "key", param) if isinstance(exc, ConfigError) else param
            return status, oa.error_body(str(exc), type_, param, CODES.get(status))
    rid = structlog.contextvars.get_contextvars().get("request_id", "-")
    return 500, oa.error_body(f"internal error (request id {rid})", "server_error", None, "internal_error")


Shape = Callable[[int, dict], dict]  # (HTTP status, OpenAI's error body) -> an API's own error body


def _anthropic_error(status: int, body: dict) -> dict:
    return an.error_body(status, body["error"]["message"])


def error_response(exc: BaseException, path: str = "", shape: Shape | None = None) -> JSONResponse:
    status, body = error_status(exc)
    if status == 500:
        log.error("http_failed", path=path, error=repr(exc), exc_info=exc)
    else:
        log.info("http_rejected", path=path, status=status, detail=body["error"]["message"])
    ra = retry_after_seconds(exc)
    headers = {"Retry-After": str(ra or RETRY_AFTER_SECONDS)} if status in (429, 503) else {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(shape(status, body) if shape else body, status_code=status, headers=headers)


def _warning_headers(ignored: Sequence[str], unserved_model: str = "", served: str = "") -> dict[str, str]:
    """The header naming what [http] strict = false let through (nothing: {}): the unknown fields
    ignored, and a model named that this server does not serve (`served` answered instead)."""
    said = [f"ignored unknown fields: {', '.join(ignored)}"] if ignored else []
    if unserved_model:
        said.append(f"model {unserved_model!r} is not served here: {served} answered")
    if not said:
        return {}
    return {"x-edgespec-warning": "; ".join(said).encode("ascii", "backslashreplace").decode()[:1000]}


def _parsed(events: Sequence[tuple[str, Any]], index: int) -> list[answer.Event]:
    """AnswerStream's ("content", text) and ("call", CallDelta) events as answer events of choice `index`."""
    return [answer.Text(index, v) if kind == "content" else answer.Call(index, v)
            for kind, v in events if kind != "content" or v]


def _content(index: int, text: str, logprobs: Sequence, offset: int,
             parsed: tools_mod.AnswerStream | tools_mod.FormatStream | None) -> list[answer.Event]:
    """A piece of a choice's content as answer events: through the tool-call parser when the
    answer may be calls (text that may still open one held back), else as it is."""
    if parsed is not None:
        return _parsed(parsed.feed(text), index)
    return [answer.Text(index, text, tuple(logprobs), offset)] if text or logprobs else []


def _calls(req: oa.CompletionRequest, result: GenerationResult, thinking: reasoning.Reasoning | None = None
           ) -> tuple[str | None, str | None, tuple[tools_mod.ToolCall, ...], str]:
    """A unary answer's (reasoning, content, tool calls, finish reason): reasoning when the model
    thinks (`thinking`), finish "tool_calls" when the answer is calls."""
    thought, text = thinking.split(result.text) if thinking is not None else (None, result.text)
    if not req.parses_calls or req.tools is None:
        return thought, text, (), result.finish_reason
    content, calls = req.tools.parse(text, truncated=result.finish_reason == "length")
    finish: str = result.finish_reason
    if calls and finish in ("stop", "eos"):
        finish = "tool_calls"
    return thought, content, calls, finish


@dataclasses.dataclass
class _Run:
    """A request's jobs on their way: `events` a stream's one queue; `first` the events its jobs
    put while they were opened (None: a job waits in the queue)."""

    jobs: list[Job]
    events: queue.SimpleQueue
    first: list[tuple] | None
    created: int
    reasoning: reasoning.Reasoning | None = None  # the model thinks: its <think> block is split off


class _Tagged:
    """A streamed choice's event queue as its job sees it: each event goes, tagged with the
    choice's index, onto the stream's one queue (one waiting thread for all n choices)."""

    def __init__(self, shared: queue.SimpleQueue, index: int):
        self.shared, self.index = shared, index

    def put(self, event: tuple[str, Any]) -> None:
        self.shared.put((*event, self.index))


class HttpApi:
    """The routes, over the daemon's engine loop, policy and auth."""

    def __init__(self, loop: EngineLoop, policy: Callable[[], Policy], auth: Callable[[], TokenAuth], *,
                 model_id: str, created: int, max_body_bytes: int, threads: int, n_ctx: int,
                 limits: LimitsConfig | None = None, chat_template: str = "",
                 embedder: emb.Embedder | None = None, strict: bool = False, callers: CallerLimits | None = None,
                 tool_format: str = "auto", reasoning_format: str = "auto",
                 metrics: Callable[[str | None, bool], tuple[bytes, str]] | None = None,
                 registry: models_api.Registry | None = None, reranker: Any = None,
                 record: Callable[[str, str, int, float], None] | None = None):
        self.loop = loop
        self.embedder = embedder
        # the served models by name and role (models_api.py): /v1/models, and what `model` routes to
        self.registry = registry or models_api.build_registry(model_id, embedder.cfg if embedder else None,
                                                              created=created)
        self.record = record or (lambda model, role, items, seconds: None)  # per-model figures ([metrics])
        # Accept header -> (exposition, content type) ([metrics] enabled), served at /metrics under the API's auth
        self.metrics = metrics
        self.callers = callers  # per-caller limits and figures (shared with gRPC), None: no limits
        self.strict = strict  # [http] strict: unknown request fields refused (else ignored with a warning header)
        self.chat_template = chat_template  # [target] chat_template's text ("" = the GGUF's own)
        self.tool_format = tool_format  # [target] tool_format (auto: the template's)
        self.reasoning_format = reasoning_format  # [target] reasoning_format (auto: the template's)
        self.n_ctx = n_ctx
        self.limits = limits or LimitsConfig()
        self.policy = policy
        self.auth = auth
        self.model_id = model_id
        self.created = created
        self.max_body_bytes = max_body_bytes
        self.limiter = anyio.CapacityLimiter(threads)  # threads waiting on engine events
        self._vocab: list[bytes] | None = None  # token -> bytes (asked of the engine once)
        self._vocab_lock = threading.Lock()
        self.model_routes = models_api.ModelRoutes(
            self.registry, reranker=reranker, max_prompt_bytes=self.limits.max_prompt_bytes, read_json=self._json,
            run=lambda fn, *args: anyio.to_thread.run_sync(lambda: fn(*args), limiter=self.limiter),
            admit=self._admit_now, record=self.record)
        rerank = self._endpoint(self.model_routes.rerank)
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._endpoint(self.chat), methods=["POST"]),
                Route("/v1/completions", self._endpoint(self.completions), methods=["POST"]),
                Route("/v1/models", self._endpoint(self.model_routes.models), methods=["GET"]),
                *[Route(path, rerank, methods=["POST"]) for path in ("/v1/rerank", "/rerank", "/v2/rerank")],
                Route("/v1/messages", self._endpoint(self.messages, shape=_anthropic_error), methods=["POST"]),
                Route("/v1/messages/count_tokens", self._endpoint(self.count_tokens, shape=_anthropic_error),
                      methods=["POST"]),
                Route("/v1/responses", self._endpoint(self.responses), methods=["POST"]),
                Route("/v1/embeddings", self._endpoint(self.embeddings), methods=["POST"]),
                *([Route("/metrics", self._endpoint(self.metrics_text, open_=True), methods=["GET"])]
                  if metrics else []),
                Route("/health", self._endpoint(self.health, open_=True), methods=["GET"]),
                Route("/tokenize", self._endpoint(self.tokenize), methods=["POST"]),
                Route("/detokenize", self._endpoint(self.detokenize), methods=["POST"]),
            ],
            exception_handlers={HTTPException: self._http_exception},
        )

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
            body = _anthropic_error(exc.status_code, body)
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

    async def _call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) on the engine thread, without blocking the event loop."""
        return await anyio.to_thread.run_sync(self.loop.call, fn, limiter=self.limiter)

    async def _vocabulary(self) -> list[bytes]:
        """Every token's bytes (for logprobs and /detokenize), read once: from the loaded target's
        thread-safe encoder when there is one, else on the engine thread."""
        if self._vocab is None:
            def read(src: Any) -> list[bytes]:
                model = src if hasattr(src, "piece") else getattr(src, "target", None)
                if model is not None and hasattr(model, "piece"):
                    return [model.piece(t) for t in range(int(model.n_vocab))]
                n = int(src.model_info().get("n_vocab", 0))
                return [src.detokenize([t]).encode() for t in range(n)]

            enc = self.loop.encoder
            if enc is not None and hasattr(enc, "piece"):
                got = await anyio.to_thread.run_sync(read, enc, limiter=self.limiter)
            else:
                got = await self._call(read)
            with self._vocab_lock:
                self._vocab = got
        return self._vocab

    async def _prompt_tokens(self, req: oa.CompletionRequest, rendered: list[str] | None = None
                             ) -> tuple[int, ...] | None:
        """The prompt tokenised here (a worker thread), as the gRPC servicer does: the engine
        thread gets token ids. None for an engine without an encoder (its thread tokenises;
        then a request with tools or tool turns is refused: they need the chat template here).
        `rendered`: the chat template's text is appended (when the Jinja template was rendered)."""
        enc = self.loop.encoder
        if enc is None:
            if not self.loop.ready:
                raise NotReady("the models are still loading")
            if req.tools is not None or req.extras:
                raise BadRequest("tools", "tool calling is not available on this server's engine")
            return None

        def encode() -> list[int]:
            return tools_mod.encode_request(enc, req.prompt, req.messages, req.extras, req.tools, self.chat_template,
                                            variables=dict(req.template_vars), jinja=req.reasons, rendered=rendered)

        return tuple(await anyio.to_thread.run_sync(encode, limiter=self.limiter))

    async def _events(self, events: queue.SimpleQueue, until_result: bool = False,
                      wait: float | None = None) -> list[tuple]:
        """The next batch of events from a job's queue, or a stream's ((kind, value, choice index)
        each): pipe.next_events in a worker thread, one thread hop per batch, not per chunk;
        raises the batch's first error (BadRequest from the engine, ...). [] when none came
        within `wait` seconds."""
        return list(pipe.raise_error(await anyio.to_thread.run_sync(lambda: pipe.next_events(
            events, until_result=until_result, stopped=lambda: self.loop.stopped, poll=POLL_SECONDS, wait=wait),
            limiter=self.limiter)))

    @staticmethod
    def _check_end(result: GenerationResult) -> None:
        pipe.check_end(result, deadline="edgespec.timeout_seconds passed")

    # ---- generation ----------------------------------------------------------------------------

    async def chat(self, request: Request, rid: str) -> Response:
        return await self._admitted(lambda hold, place: self._openai(request, rid, True, hold, place))

    async def completions(self, request: Request, rid: str) -> Response:
        return await self._admitted(lambda hold, place: self._openai(request, rid, False, hold, place))

    async def _admitted(self, run: Callable[[contextlib.ExitStack, Place | Unlimited], Awaitable[Response]]
                        ) -> Response:
        """run(hold, place) admitted under the caller's own limits ([limits] caller_*) for as long
        as it runs (a stream: until it ends; `hold` holds its places)."""
        hold = contextlib.ExitStack()
        place: Place | Unlimited = UNLIMITED
        if self.callers is not None:
            place = hold.enter_context(self.callers.admit(current_caller()))
        try:
            resp = await run(hold, place)
        except BaseException:
            hold.close()
            raise
        if not isinstance(resp, StreamingResponse):
            hold.close()
        return resp

    def _parse(self, parse: Callable[[], oa.CompletionRequest]) -> oa.CompletionRequest:
        """A parsed request; an unknown model is a 404 ([http] strict = true)."""
        try:
            return parse()
        except BadRequest as exc:
            if exc.field == "model":
                raise UnknownModel("model", str(exc).split(": ", 1)[-1]) from None
            raise

    def _route(self, name: Any) -> None:
        """A chat request's `model`: a model of another role is a 400 naming the field; an unknown
        one a 404 listing the served ones under [http] strict (else the chat model answers it)."""
        if isinstance(name, str) and name:
            self.registry.resolve("chat", name, strict=self.strict)

    def _admit_now(self) -> Any:
        """The caller's place for a request that runs at once, outside the engine's slots."""
        return self.callers.admit(current_caller(), queued=False) if self.callers is not None else \
            contextlib.nullcontext(UNLIMITED)

    def _tool_format(self) -> str:
        """The call format the model writes: [target] tool_format, or the one its chat template writes."""
        return tools_mod.call_format(self.loop.encoder, self.chat_template, self.tool_format)

    def _reasoning_format(self) -> str:
        """Whether the model thinks: [target] reasoning_format, or what its chat template writes."""
        enc = self.loop.encoder
        if self.reasoning_format != "auto" or enc is None:
            return self.reasoning_format if self.reasoning_format != "auto" else "none"
        return reasoning.format_for(chat_encoding.template_of(enc, self.chat_template or None))

    def _check_capabilities(self, req: oa.CompletionRequest, field: str) -> None:
        """A constraint (`field` names where the request asked for one) needs an engine that applies it."""
        if req.constraint is not None:
            if "constraint" not in self.loop.capabilities:
                raise BadRequest(field, "structured output is not available on this server's engine yet")
            convert.constraint_within(req.constraint, field, self.limits)

    async def _openai(self, request: Request, rid: str, chat: bool, hold: contextlib.ExitStack,
                      place: Place | Unlimited) -> Response:
        body = await self._json(request)
        self._route(body.get("model") if isinstance(body, dict) else None)
        req = self._parse(lambda: oa.parse_request(body, chat=chat, policy=self.policy(), models=(self.model_id,),
                                                   limits=self.limits, strict=self.strict,
                                                   tool_format=self._tool_format(),
                                                   reasoning_format=self._reasoning_format()))
        field = ("edgespec.constraint" if isinstance(body.get("edgespec"), dict) and
                 body["edgespec"].get("constraint") is not None else
                 "tools" if req.tools is not None and body.get("response_format") is None else "response_format")
        self._check_capabilities(req, field)
        piece: oa.Piece | None = None
        if req.logprobs is not None:
            pieces = await self._vocabulary()
            piece = lambda t: pieces[t] if 0 <= t < len(pieces) else b""
        run = await self._start(req, rid, hold, place, field)
        rid_out = ("chatcmpl-" if chat else "cmpl-") + rid
        warning = _warning_headers(req.ignored, req.unserved_model, self.model_id)
        if req.stream:
            fmt = oa.CompletionStream(req, rid=rid_out, created=run.created, model=self.model_id, n=req.n,
                                      piece=piece)
            return self._stream_response(req, run, fmt, hold, warning)
        results = await self._results(request, run.jobs)
        n_prompt = len(run.jobs[0].prompt_tokens or ())
        bodies = [oa.completion_body(req, rid=rid_out, created=run.created, model=self.model_id, result=r,
                                     prompt_tokens=n_prompt, timings=j.timings(), piece=piece or (lambda t: b""),
                                     reasoning=run.reasoning)
                  for r, j in zip(results, run.jobs)]
        return JSONResponse(bodies[0] if req.n == 1 else oa.choices_body(bodies), headers=warning)

    async def _start(self, req: oa.CompletionRequest, rid: str, hold: contextlib.ExitStack,
                     place: Place | Unlimited, constraint_field: str = "constraint") -> _Run:
        """The request's jobs submitted; a stream's, once they are open (see _opening)."""
        deadline = time.monotonic() + req.timeout_seconds if req.timeout_seconds else None
        rendered: list[str] = []
        tokens = await self._prompt_tokens(req, rendered)
        created = int(time.time())
        thinking = reasoning.Reasoning(bool(rendered) and reasoning.opened(rendered[-1]), req.reasoning_budget) \
            if req.reasons else None
        sub = req
        if thinking is not None and thinking.budget is not None and "constraint" not in self.loop.capabilities:
            raise BadRequest("edgespec.reasoning_budget", "a reasoning budget is not available on this server's engine")
        if thinking is not None and (req.constraint is not None or thinking.budget is not None):
            # the constraint holds after the reasoning; the budget on it (edgespec/budget.py)
            calls = req.tools is not None and req.tools.calls_allowed
            inner = req.tools.constraint((reasoning.OPEN,)) if calls and req.tools is not None else req.constraint
            sub = dataclasses.replace(req, constraint=thinking.constraint(inner))
        # each choice's grammar state, compiled on a worker thread: neither this event loop nor
        # the engine thread waits for a large schema or grammar
        matchers = [await anyio.to_thread.run_sync(self.loop.compile, sub.constraint, limiter=self.limiter)
                    for _ in range(sub.n)] if sub.constraint is not None else [None] * sub.n
        jobs, events = self._submit(sub, rid, tokens, deadline, hold, place, matchers, constraint_field)
        first: list[tuple] | None = None
        if req.stream:
            try:
                first = await self._opening(jobs, events)
            except BaseException:
                for job in jobs:
                    job.cancel()
                raise
        return _Run(jobs, events, first, created, thinking)

    async def _opening(self, jobs: Sequence[Job], events: queue.SimpleQueue) -> list[tuple] | None:
        """Before a stream's status line: the events its jobs put while the engine opened them
        (an error the engine raises then, a prompt too long say, is still a status code). None,
        and the status line at once, when a job waits in the queue (behind other requests, or
        for its caller's place for longer than OPEN_WAIT_SECONDS): the stream then begins with
        a keep-alive, and such an error comes as the stream's error event."""
        if any(job.queued for job in jobs):
            return None

        def wait() -> bool:
            until = time.monotonic() + OPEN_WAIT_SECONDS
            for job in jobs:
                while not job.opened.wait(POLL_SECONDS):
                    if self.loop.stopped:
                        raise NotReady("the engine stopped")
                    if time.monotonic() >= until:
                        return False
            return True

        if not await anyio.to_thread.run_sync(wait, limiter=self.limiter):
            return None
        got: list[tuple] = []
        with contextlib.suppress(queue.Empty):
            while True:
                got.append(events.get_nowait())
        return list(pipe.raise_error(got))

    async def _results(self, request: Request, jobs: Sequence[Job]) -> list[GenerationResult]:
        try:
            return [await self._unary(request, job) for job in jobs]
        finally:
            for job in jobs:
                if job.finished is None:
                    job.cancel()

    def _stream_response(self, req: oa.CompletionRequest, run: _Run, fmt: answer.StreamFormat,
                         hold: contextlib.ExitStack,
                         headers: dict[str, str]) -> StreamingResponse:
        return StreamingResponse(self._sse(fmt, self._answer(req, run), run.jobs, hold),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    def _submit(self, req: oa.CompletionRequest, rid: str, tokens: tuple[int, ...] | None, deadline: float | None,
                hold: contextlib.ExitStack, place: Place | Unlimited,
                matchers: Sequence[Any] = (), constraint_field: str = "constraint") -> tuple[list[Job], queue.SimpleQueue]:
        """The request's n jobs of the one prompt, submitted together (each its own slot and its own
        place under the caller's limits, `place` the first's; with a seed, choice i samples with
        seed + i).
        A stream's jobs put their events, tagged with the choice's index, on the one queue
        returned (a unary request's jobs keep their own)."""
        places = [place]
        if self.callers is not None:
            places += [hold.enter_context(self.callers.admit(current_caller())) for _ in range(req.n - 1)]
        else:
            places *= req.n
        caller = structlog.contextvars.get_contextvars().get("caller", "")
        shared: queue.SimpleQueue = queue.SimpleQueue()
        jobs: list[Job] = []
        try:
            for i in range(req.n):
                s = req.sampling if req.sampling.seed is None else \
                    dataclasses.replace(req.sampling, seed=(req.sampling.seed + i) % (1 << 63))
                # in flight until it ends, each choice holds its tokens (the prompt, once) against
                # the caller's tokens-per-minute limit; the engine charges what it cost as it ends
                places[i].reserve(len(tokens or ()) * (i == 0) + s.max_tokens)
                job = Job(request_id=f"{rid}.{i}" if i else rid, sampling=s, speculation=req.speculation,
                          prompt=req.prompt, messages=req.messages, prompt_tokens=tokens, logprobs=req.logprobs,
                          constraint=req.constraint, matcher=matchers[i] if matchers else None, deadline=deadline,
                          caller=caller, place=places[i], charge_prompt=i == 0, constraint_field=constraint_field)
                if req.stream:
                    job.events = _Tagged(shared, i)  # type: ignore[assignment]
                self.loop.submit(job)
                jobs.append(job)
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
        return jobs, shared

    async def _unary(self, request: Request, job: Job) -> GenerationResult:
        """Wait for the result; the client going away cancels the job."""
        async def watch() -> None:
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    job.cancel()
                    return

        failed: Exception | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                try:  # raised outside the task group, or it would come wrapped in an ExceptionGroup
                    kind, value = (await self._events(job.events, until_result=True))[-1]
                except Exception as exc:  # re-raised below
                    failed = exc
                tg.cancel_scope.cancel()
            if failed is not None:
                raise failed
            self._check_end(value)
            return value
        finally:
            if job.finished is None:
                job.cancel()

    async def _answer(self, req: oa.CompletionRequest, run: _Run) -> AsyncIterator[answer.Event]:
        """A stream's answer events (edgespec.server.answer) from its jobs' chunks: the text, with
        tool calls parsed out of it as they come when the request has tools (text that may still
        open a call is held back until it cannot); each choice's End; then the Usage. Waiting
        while nothing came for KEEPALIVE_SECONDS (or at once while queued). A result that did not
        end on its own raises its error."""
        jobs = run.jobs
        n = len(jobs)
        results: list[GenerationResult | None] = [None] * n
        offsets = [0] * n
        answers = [req.tools.stream() if req.parses_calls and req.tools is not None else None for _ in jobs]
        splitters = [reasoning.ReasoningSplitter(run.reasoning.opened) if run.reasoning is not None else None
                     for _ in jobs]
        batch = run.first
        if batch is None:
            yield answer.Waiting()
            batch = []
        while True:
            for kind, value, i in batch:
                parsed = answers[i]
                split = splitters[i]
                if kind == "chunk":
                    c: Chunk = value
                    if split is None:
                        for ev in _content(i, c.text, c.logprobs, offsets[i], parsed):
                            yield ev
                        offsets[i] += len(c.text)
                        continue
                    for part, text in split.feed(c.text):  # the reasoning, then the content (no logprobs)
                        for ev in [answer.Reasoning(i, text)] if part == "reasoning" else \
                                _content(i, text, (), offsets[i], parsed):
                            yield ev
                        offsets[i] += len(text) if part == "content" else 0
                    continue
                result: GenerationResult = value
                results[i] = result  # what it cost is charged by the engine as it ends
                self._check_end(result)
                finish: str = result.finish_reason
                for part, text in split.finish() if split is not None else ():
                    for ev in [answer.Reasoning(i, text)] if part == "reasoning" else \
                            _content(i, text, (), offsets[i], parsed):
                        yield ev
                if parsed is not None:
                    for ev in _parsed(parsed.finish(), i):
                        yield ev
                    if parsed.calls and finish in ("stop", "eos"):
                        finish = "tool_calls"
                yield answer.End(i, result, finish, jobs[i].timings(), await self._stop_sequence(req, result))
            if all(r is not None for r in results):
                break
            batch = await self._events(run.events, wait=KEEPALIVE_SECONDS)
            if not batch:
                yield answer.Waiting()
        yield answer.Usage([r for r in results if r is not None], len(jobs[0].prompt_tokens or ()))

    async def _stop_sequence(self, req: oa.CompletionRequest, result: GenerationResult) -> str | None:
        """The stop string that ended a result (finish reason "stop"): the one its tokens' text
        goes on with where the answer's text was cut."""
        stops = req.sampling.stop
        if result.finish_reason != "stop" or not stops:
            return None
        if len(stops) == 1:
            return stops[0]
        pieces = await self._vocabulary()
        full = b"".join(pieces[t] for t in result.token_ids if 0 <= t < len(pieces)).decode("utf-8", "replace")
        return next((s for s in stops if full.startswith(s, len(result.text))), None)

    async def _sse(self, fmt: answer.StreamFormat, source: AsyncIterator[answer.Event], jobs: Sequence[Job],
                   hold: contextlib.ExitStack) -> AsyncIterator[bytes]:
        """A stream's bytes in the API's format. An error ends the stream with the format's error
        event (the status line is sent); the client going away, or the stream breaking, cancels
        every choice's job."""
        done = False
        try:
            if head := fmt.start():
                yield head
            async with contextlib.aclosing(source) as events:  # type: ignore[type-var]
                async for ev in events:
                    if data := fmt.event(ev):
                        yield data
            done = True
        except Exception as exc:  # the status line is sent: the error goes in the stream
            done = True
            status, body = error_status(exc)
            if status == 500:
                log.error("http_stream_failed", error=repr(exc), exc_info=exc)
            yield fmt.error(status, body["error"]["message"], body)
        finally:
            for job in jobs:
                if not done or job.finished is None:
                    job.cancel()  # the client went away (the generator was closed) or the stream broke
            hold.close()  # the caller's places
        if tail := fmt.end():
            yield tail

    # ---- Anthropic's Messages API ------------------------------------------------------------

    def _translated(self, chat: dict, rename: Callable[[BadRequest], BadRequest]) -> oa.CompletionRequest:
        """A chat body translated from another API's (Messages, Responses) as the chat pipeline's
        request; a field error renamed as that API names the field."""
        try:
            self._route(chat.get("model"))
            return self._parse(lambda: oa.parse_request(chat, chat=True, policy=self.policy(),
                                                        models=(self.model_id,), limits=self.limits,
                                                        strict=self.strict, tool_format=self._tool_format(),
                                                        reasoning_format=self._reasoning_format()))
        except BadRequest as exc:
            raise rename(exc) from None

    def _anthropic(self, body: Any, *, count: bool = False) -> tuple[oa.CompletionRequest, tuple[str, ...]]:
        """A Messages body as the chat pipeline's request, and the unknown fields ignored."""
        chat, ignored, origin = an.to_chat(body, strict=self.strict, count=count)
        return self._translated(chat, lambda exc: an.renamed(exc, origin)), ignored

    async def messages(self, request: Request, rid: str) -> Response:
        return await self._admitted(lambda hold, place: self._messages(request, rid, hold, place))

    async def _messages(self, request: Request, rid: str, hold: contextlib.ExitStack,
                        place: Place | Unlimited) -> Response:
        req, ignored = self._anthropic(await self._json(request))
        self._check_capabilities(req, "tools")
        run = await self._start(req, rid, hold, place, "tools")
        rid_out = "msg_" + rid
        n_prompt = len(run.jobs[0].prompt_tokens or ())
        warning = _warning_headers(ignored, req.unserved_model, self.model_id)
        if req.stream:
            fmt = an.MessageStream(rid=rid_out, model=self.model_id, input_tokens=n_prompt)
            return self._stream_response(req, run, fmt, hold, warning)
        (result,) = await self._results(request, run.jobs)
        thought, content, calls, finish = _calls(req, result, run.reasoning)
        body = an.message_body(rid=rid_out, model=self.model_id, content=content, calls=calls, finish=finish,
                               thinking=thought,
                               stop_sequence=await self._stop_sequence(req, result),
                               input_tokens=result.prompt_tokens or n_prompt, output_tokens=len(result.token_ids),
                               stats=oa.speculation_stats(result, run.jobs[0].timings()))
        return JSONResponse(body, headers=warning)

    async def count_tokens(self, request: Request, rid: str) -> Response:
        req, ignored = self._anthropic(await self._json(request), count=True)
        tokens = await self._prompt_tokens(req)
        if tokens is None:  # an engine without an encoder: on its own thread, the engine the tokenizer
            tokens = tuple(await self._call(lambda tok: chat_encoding.encode_prompt(tok, req.prompt, req.messages)))
        return JSONResponse({"input_tokens": len(tokens)},
                            headers=_warning_headers(ignored, req.unserved_model, self.model_id))

    # ---- OpenAI's Responses API ---------------------------------------------------------------

    async def responses(self, request: Request, rid: str) -> Response:
        return await self._admitted(lambda hold, place: self._responses(request, rid, hold, place))

    async def _responses(self, request: Request, rid: str, hold: contextlib.ExitStack,
                         place: Place | Unlimited) -> Response:
        body = await self._json(request)
        chat, ignored, origin = ra.to_chat(body, strict=self.strict)
        req = self._translated(chat, lambda exc: ra.renamed(exc, origin))
        field = "tools" if req.tools is not None and chat.get("response_format") is None else "text.format"
        self._check_capabilities(req, field)
        run = await self._start(req, rid, hold, place, field)
        base = ra.base_body(body, rid="resp_" + rid, created=run.created, model=self.model_id)
        n_prompt = len(run.jobs[0].prompt_tokens or ())
        warning = _warning_headers(ignored, req.unserved_model, self.model_id)
        if req.stream:
            return self._stream_response(req, run, ra.ResponseStream(base, prompt_tokens=n_prompt), hold,
                                         warning)
        (result,) = await self._results(request, run.jobs)
        thought, content, calls, finish = _calls(req, result, run.reasoning)
        out = ra.response_body(base, output=ra.output_items(content, calls, finish, thought), finish=finish,
                               usage=ra.usage([result], n_prompt),
                               stats=oa.speculation_stats(result, run.jobs[0].timings()))
        return JSONResponse(out, headers=warning)

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

    async def embeddings(self, request: Request, rid: str) -> Response:
        body = await self._json(request)
        if self.embedder is None:
            raise UnknownModel("model", "embeddings are off on this server ([embedding] enabled = false)")
        req = emb.parse_request(body, models=None, max_inputs=self.embedder.cfg.max_inputs,
                                max_bytes=self.limits.max_prompt_bytes)
        served = self.registry.pick("embedding", req.model)
        started = time.monotonic()
        with self._admit_now() as place:  # runs at once, outside the engine's slots
            vectors, n = await anyio.to_thread.run_sync(self.embedder.embed, req.inputs, limiter=self.limiter)
            place.used(n)
        self.record(served.id, "embedding", len(req.inputs), time.monotonic() - started)
        return JSONResponse(emb.response_body(vectors, model=served.id, prompt_tokens=n,
                                              encoding_format=req.encoding_format))

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
            ids = await anyio.to_thread.run_sync(encode, enc, limiter=self.limiter)
        else:  # an engine without an encoder: on its own thread, the engine itself the tokenizer
            ids = await self._call(encode)
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
        pieces = await self._vocabulary()
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


__all__: Sequence[str] = ("HttpApi", "STATUS", "client_subject", "error_response", "error_status")
