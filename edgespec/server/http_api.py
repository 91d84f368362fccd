"""The OpenAI-compatible HTTP API: a Starlette app, served by uvicorn in a thread of the daemon
(edgespec/server/http_server.py).

Starlette + uvicorn rather than FastAPI: the routes validate their bodies themselves
(openai_api.py) so that a bad field is a 400 naming it in OpenAI's error shape, not pydantic's
422; what is left is routing, requests, streaming responses and an ASGI server, which Starlette
and uvicorn are (FastAPI would add pydantic models we would not use).

Both APIs share one engine: a request becomes an engine_loop.Job submitted to the daemon's
EngineLoop (same admission queue, metrics, deadlines and request-id logging as gRPC); a client
that disconnects cancels its job. Errors are domain exceptions mapped to HTTP codes in ONE place
(`STATUS` / `error_response`), as status.py maps them to gRPC codes.

Routes: POST /v1/chat/completions, POST /v1/completions (unary, or server-sent events ending
`data: [DONE]` with stream: true), GET /v1/models, GET /health (200 only when SERVING),
POST /tokenize, POST /detokenize. Every route but /health needs a bearer token when tokens are
configured (the gRPC token files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgespec import chat as chat_encoding
from edgespec import tools as tools_mod
from edgespec.errors import (BadRequest, Cancelled, ConfigError, DeadlineExceeded, EdgespecError, NotReady,
                             Overloaded)
from edgespec.logs import bind_request_id, clear_request, get_logger
from edgespec.server import openai_api as oa
from edgespec.server import embeddings as emb
from edgespec.server import convert, pipe
from edgespec.server.auth import TokenAuth
from edgespec.server.callers import UNLIMITED, CallerLimits, Place, Unlimited, current_caller, retry_after_seconds
from edgespec.server.config import LimitsConfig
from edgespec.server.engine_loop import EngineLoop, Job
from edgespec.server.policy import Policy
from edgespec.types import Chunk, GenerationResult

log = get_logger("edgespec.server.http_api")

POLL_SECONDS = pipe.POLL_SECONDS  # how often a waiting request looks whether the engine is still there
RETRY_AFTER_SECONDS = 1
AUTH_METHOD = "/edgespec.v1.Inference/HTTP"  # what TokenAuth.check sees for an HTTP route


class Unauthenticated(EdgespecError):
    """Missing or unknown bearer token."""


class PayloadTooLarge(BadRequest):
    """The request body is larger than server.max_message_bytes."""


class UnknownModel(BadRequest):
    """The request names a model this server does not serve."""


# ---- the ONE place where errors become HTTP codes (most specific first) ----------------------

STATUS: tuple[tuple[type[BaseException], int, str], ...] = (
    (PayloadTooLarge, 413, "invalid_request_error"),
    (UnknownModel, 404, "invalid_request_error"),
    (BadRequest, 400, "invalid_request_error"),
    (ConfigError, 400, "invalid_request_error"),
    (Unauthenticated, 401, "authentication_error"),
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


def error_response(exc: BaseException, path: str = "") -> JSONResponse:
    status, body = error_status(exc)
    if status == 500:
        log.error("http_failed", path=path, error=repr(exc), exc_info=exc)
    else:
        log.info("http_rejected", path=path, status=status, detail=body["error"]["message"])
    ra = retry_after_seconds(exc)
    headers = {"Retry-After": str(ra or RETRY_AFTER_SECONDS)} if status in (429, 503) else {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body, status_code=status, headers=headers)


def _warning_headers(req: oa.CompletionRequest) -> dict[str, str]:
    """The header naming the unknown fields ignored under [http] strict = false (none: {})."""
    if not req.ignored:
        return {}
    names = ", ".join(req.ignored).encode("ascii", "backslashreplace").decode()[:1000]
    return {"x-edgespec-warning": f"ignored unknown fields: {names}"}


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


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
                 embedder: emb.Embedder | None = None, strict: bool = True, callers: CallerLimits | None = None,
                 metrics: Callable[[str | None], tuple[bytes, str]] | None = None):
        self.loop = loop
        self.embedder = embedder
        # Accept header -> (exposition, content type) ([metrics] enabled), served at /metrics under the API's auth
        self.metrics = metrics
        self.callers = callers  # per-caller limits and figures (shared with gRPC), None: no limits
        self.strict = strict  # [http] strict: unknown request fields refused (else ignored with a warning header)
        self.chat_template = chat_template  # [target] chat_template's text ("" = the GGUF's own)
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
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._endpoint(self.chat), methods=["POST"]),
                Route("/v1/completions", self._endpoint(self.completions), methods=["POST"]),
                Route("/v1/models", self._endpoint(self.models), methods=["GET"]),
                Route("/v1/embeddings", self._endpoint(self.embeddings), methods=["POST"]),
                *([Route("/metrics", self._endpoint(self.metrics_text), methods=["GET"])] if metrics else []),
                Route("/health", self._endpoint(self.health, open_=True), methods=["GET"]),
                Route("/tokenize", self._endpoint(self.tokenize), methods=["POST"]),
                Route("/detokenize", self._endpoint(self.detokenize), methods=["POST"]),
            ],
            exception_handlers={HTTPException: self._http_exception},
        )

    # ---- plumbing ------------------------------------------------------------------------------

    def _endpoint(self, fn: Callable, open_: bool = False) -> Callable:
        """Request id, auth and error mapping around a route."""
        async def handle(request: Request) -> Response:
            clear_request()
            started = time.monotonic()
            caller_rid = request.headers.get("x-request-id", "")
            rid = uuid.uuid4().hex[:16]
            client = request.client
            peer = f"{'ipv6' if client and ':' in client.host else 'ipv4'}:{client.host}:{client.port}" \
                if client else "unknown"
            bind_request_id(request_id=rid, peer=peer)
            decision = self.auth().decide(AUTH_METHOD, request.headers.get("authorization"),
                                          client_subject(request.scope))
            bind_request_id(caller=decision.identity)
            try:
                caller_rid = pipe.request_id(caller_rid, "x-request-id")  # as over gRPC: refused by name
                if caller_rid:
                    rid = caller_rid  # the job takes the caller's id
                    bind_request_id(request_id=rid, x_request_id=caller_rid)
                if not open_ and decision.verdict is not None:
                    raise Unauthenticated("missing or invalid bearer token (header 'Authorization: Bearer <token>') "
                                          "or client certificate")
                resp = await fn(request, rid)
            except Exception as exc:  # noqa: BLE001 - mapped in one place
                resp = error_response(exc, request.url.path)
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
        return JSONResponse(oa.error_body(f"{request.method} {request.url.path}: {exc.detail}", type_, code=code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

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

    async def _prompt_tokens(self, req: oa.CompletionRequest) -> tuple[int, ...] | None:
        """The prompt tokenised here (a worker thread), as the gRPC servicer does: the engine
        thread gets token ids. None for an engine without an encoder (its thread tokenises;
        then a request with tools or tool turns is refused: they need the chat template here)."""
        enc = self.loop.encoder
        if enc is None:
            if not self.loop.ready:
                raise NotReady("the models are still loading")
            if req.tools is not None or req.extras:
                raise BadRequest("tools", "tool calling is not available on this server's engine")
            return None

        return tuple(await anyio.to_thread.run_sync(tools_mod.encode_request, enc, req.prompt, req.messages,
                                                    req.extras, req.tools, self.chat_template,
                                                    limiter=self.limiter))

    async def _events(self, events: queue.SimpleQueue, until_result: bool = False) -> list[tuple]:
        """The next batch of events from a job's queue, or a stream's ((kind, value, choice index)
        each): pipe.next_events in a worker thread, one thread hop per batch, not per chunk;
        raises the batch's first error (BadRequest from the engine, ...)."""
        return list(pipe.raise_error(await anyio.to_thread.run_sync(lambda: pipe.next_events(
            events, until_result=until_result, stopped=lambda: self.loop.stopped, poll=POLL_SECONDS),
            limiter=self.limiter)))

    @staticmethod
    def _check_end(result: GenerationResult) -> None:
        pipe.check_end(result, deadline="edgespec.timeout_seconds passed")

    # ---- generation ----------------------------------------------------------------------------

    async def chat(self, request: Request, rid: str) -> Response:
        return await self._generate(request, rid, chat=True)

    async def completions(self, request: Request, rid: str) -> Response:
        return await self._generate(request, rid, chat=False)

    async def _generate(self, request: Request, rid: str, *, chat: bool) -> Response:
        """Admitted under the caller's own limits ([limits] caller_*) for as long as it runs (a
        stream: until it ends)."""
        hold = contextlib.ExitStack()
        place: Place | Unlimited = UNLIMITED
        if self.callers is not None:
            place = hold.enter_context(self.callers.admit(current_caller()))
        try:
            resp = await self._generate_admitted(request, rid, chat=chat, hold=hold, place=place)
        except BaseException:
            hold.close()
            raise
        if not isinstance(resp, StreamingResponse):
            hold.close()
        return resp

    async def _generate_admitted(self, request: Request, rid: str, *, chat: bool, hold: contextlib.ExitStack,
                                 place: Place | Unlimited) -> Response:
        body = await self._json(request)
        try:
            req = oa.parse_request(body, chat=chat, policy=self.policy(), models=(self.model_id,), limits=self.limits,
                                   strict=self.strict)
        except BadRequest as exc:
            if exc.field == "model":
                raise UnknownModel("model", str(exc).split(": ", 1)[-1]) from None
            raise
        caps = self.loop.capabilities
        if req.constraint is not None:
            field = "edgespec.constraint" if isinstance(body.get("edgespec"), dict) and \
                body["edgespec"].get("constraint") is not None else \
                "tools" if req.tools is not None and body.get("response_format") is None else "response_format"
            if "constraint" not in caps:
                raise BadRequest(field, "structured output is not available on this server's engine yet")
            convert.constraint_within(req.constraint, field, self.limits)
        piece: oa.Piece | None = None
        if req.logprobs is not None:
            pieces = await self._vocabulary()
            piece = lambda t: pieces[t] if 0 <= t < len(pieces) else b""  # noqa: E731
        deadline = time.monotonic() + req.timeout_seconds if req.timeout_seconds else None
        tokens = await self._prompt_tokens(req)
        rid_out = ("chatcmpl-" if chat else "cmpl-") + rid
        created = int(time.time())
        # each choice's grammar state, compiled on a worker thread: neither this event loop nor
        # the engine thread waits for a large schema or grammar
        matchers = [await anyio.to_thread.run_sync(self.loop.compile, req.constraint, limiter=self.limiter)
                    for _ in range(req.n)] if req.constraint is not None else [None] * req.n
        jobs, events = self._submit(req, rid, tokens, deadline, hold, place, matchers)
        warning = _warning_headers(req)
        if req.stream:
            try:  # wait for the first events: an error the engine raises on admission is still a status code
                first = await self._events(events)
            except BaseException:
                for job in jobs:
                    job.cancel()
                raise
            return StreamingResponse(self._stream(req, jobs, events, first, rid_out, created, piece, hold),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache", **warning})
        try:
            results = [await self._unary(request, job) for job in jobs]
        finally:
            for job in jobs:
                if job.finished is None:
                    job.cancel()
        n_prompt = len(jobs[0].prompt_tokens or ())  # what they cost is charged by the engine as each ends
        bodies = [oa.completion_body(req, rid=rid_out, created=created, model=self.model_id, result=r,
                                     prompt_tokens=n_prompt, timings=j.timings(), piece=piece or (lambda t: b""))
                  for r, j in zip(results, jobs)]
        return JSONResponse(bodies[0] if req.n == 1 else oa.choices_body(bodies), headers=warning)

    def _submit(self, req: oa.CompletionRequest, rid: str, tokens: tuple[int, ...] | None, deadline: float | None,
                hold: contextlib.ExitStack, place: Place | Unlimited,
                matchers: Sequence[Any] = ()) -> tuple[list[Job], queue.SimpleQueue]:
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
                          caller=caller,
                          place=places[i],
                          charge_prompt=i == 0)
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
                except Exception as exc:  # noqa: BLE001 - re-raised below
                    failed = exc
                tg.cancel_scope.cancel()
            if failed is not None:
                raise failed
            self._check_end(value)
            return value
        finally:
            if job.finished is None:
                job.cancel()

    async def _stream(self, req: oa.CompletionRequest, jobs: Sequence[Job], events: queue.SimpleQueue,
                      first: list[tuple[str, Any, int]], rid: str, created: int, piece: oa.Piece | None,
                      hold: contextlib.ExitStack | None = None) -> AsyncIterator[bytes]:
        """The choices' chunks interleaved as they come (choice i's at index i), each choice
        ending with its own finish_reason chunk; then the usage (with include_usage) and [DONE]
        once. A choice that fails ends the stream with the error event; the client going away,
        or the stream breaking, cancels every choice's job."""
        kw = {"rid": rid, "created": created, "model": self.model_id}
        n = len(jobs)
        results: list[GenerationResult | None] = [None] * n
        offsets = [0] * n
        answers = [tools_mod.AnswerStream() if req.parses_calls else None for _ in jobs]
        done = False
        try:
            if req.chat:
                for i in range(n):
                    yield _sse(oa.chunk_body(req, text=None, role=True, index=i, **kw))
            batch = first
            while True:
                for kind, value, i in batch:
                    answer = answers[i]
                    if kind == "chunk":
                        c: Chunk = value
                        if answer is not None:  # text held back while it may open a call; calls as they come
                            for body in oa.tool_chunks(req, answer.feed(c.text), index=i, **kw):
                                yield _sse(body)
                        elif c.text or c.logprobs:
                            yield _sse(oa.chunk_body(req, text=c.text, logprobs=c.logprobs, piece=piece,
                                                     offset=offsets[i], index=i, **kw))
                        offsets[i] += len(c.text)
                        continue
                    result: GenerationResult = value
                    results[i] = result
                    self._check_end(result)
                    finish = result.finish_reason
                    if answer is not None:
                        for body in oa.tool_chunks(req, answer.finish(), index=i, **kw):
                            yield _sse(body)
                        if answer.calls and finish in ("stop", "eos"):
                            finish = "tool_calls"
                    last = oa.chunk_body(req, text=None, finish=finish, index=i, **kw)
                    last["edgespec"] = oa.speculation_stats(result, jobs[i].timings())
                    yield _sse(last)
                if all(r is not None for r in results):
                    break
                batch = await self._events(events)
            done = True
            if req.include_usage:
                ended = [r for r in results if r is not None]
                yield _sse({"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
                            "created": created, "model": self.model_id, "choices": [],
                            "usage": oa.choices_usage(ended, len(jobs[0].prompt_tokens or ()))})
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            done = True
            _status, body = error_status(exc)
            if _status == 500:
                log.error("http_stream_failed", error=repr(exc), exc_info=exc)
            yield _sse(body)
        finally:
            for job in jobs:
                if not done or job.finished is None:
                    job.cancel()  # the client went away (the generator was closed) or the stream broke
            if hold is not None:
                hold.close()  # the caller's places
        yield b"data: [DONE]\n\n"

    # ---- the rest ------------------------------------------------------------------------------

    async def models(self, request: Request, rid: str) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "edgespec"}]})

    async def metrics_text(self, request: Request, rid: str) -> Response:
        assert self.metrics is not None
        body, content_type = self.metrics(request.headers.get("accept"))
        return Response(body, headers={"content-type": content_type})

    @property
    def embedding_model_id(self) -> str:
        path = self.embedder.cfg.path if self.embedder is not None else ""
        return Path(path).name.removesuffix(".gguf") if path else self.model_id

    async def embeddings(self, request: Request, rid: str) -> Response:
        body = await self._json(request)
        if self.embedder is None:
            raise UnknownModel("model", "embeddings are off on this server ([embedding] enabled = false)")
        names = tuple(dict.fromkeys((self.embedding_model_id, self.model_id)))
        try:
            req = emb.parse_request(body, models=names, max_inputs=self.embedder.cfg.max_inputs,
                                    max_bytes=self.limits.max_prompt_bytes)
        except BadRequest as exc:
            if exc.field == "model":
                raise UnknownModel("model", str(exc).split(": ", 1)[-1]) from None
            raise
        with self.callers.admit(current_caller(), queued=False) if self.callers is not None else \
                contextlib.nullcontext(UNLIMITED) as place:  # runs at once, outside the engine's slots
            vectors, n = await anyio.to_thread.run_sync(self.embedder.embed, req.inputs, limiter=self.limiter)
            place.used(n)
        return JSONResponse(emb.response_body(vectors, model=self.embedding_model_id, prompt_tokens=n,
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


def client_subject(scope: dict) -> tuple[str, str] | None:
    """The verified client certificate's (subject, common name) from the ASGI TLS extension
    (scope["extensions"]["tls"], filled by http_server.PeerCertificates under mutual TLS), or None."""
    return scope.get("extensions", {}).get("tls", {}).get("client_subject")


__all__: Sequence[str] = ("HttpApi", "STATUS", "client_subject", "error_response", "error_status")
