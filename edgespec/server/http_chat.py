"""The generating routes: OpenAI's chat and completions (openai_api.py), Anthropic's Messages and
count_tokens (anthropic_api.py) and OpenAI's Responses (responses_api.py). Each parses its body
into the chat pipeline's request (Messages and Responses translate theirs, a field error renamed
as that API names it), checks what the engine must apply (pipe.check_capabilities, shared with
gRPC), runs its jobs (http_jobs.py) and writes the answer in its own shape: a JSON body, or a
stream (http_stream.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edgespec import chat as chat_encoding
from edgespec import reasoning
from edgespec import tools as tools_mod
from edgespec.errors import BadRequest, UnknownModel
from edgespec.server import anthropic_api as an
from edgespec.server import models_api, pipe
from edgespec.server import openai_api as oa
from edgespec.server import responses_api as ra
from edgespec.server.callers import Place, Unlimited
from edgespec.server.config import LimitsConfig
from edgespec.server.http_jobs import HttpJobs
from edgespec.server.http_stream import stream_response
from edgespec.server.policy import Policy
from edgespec.types import GenerationResult


def _warning_headers(ignored: Sequence[str], unserved_model: str = "", served: str = "") -> dict[str, str]:
    """The header naming what [http] strict = false let through (nothing: {}): the unknown fields
    ignored, and a model named that this server does not serve (`served` answered instead)."""
    said = [f"ignored unknown fields: {', '.join(ignored)}"] if ignored else []
    if unserved_model:
        said.append(f"model {unserved_model!r} is not served here: {served} answered")
    if not said:
        return {}
    return {"x-edgespec-warning": "; ".join(said).encode("ascii", "backslashreplace").decode()[:1000]}


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


class ChatRoutes:
    """The chat model's routes over its jobs; `read_json` reads a body within the size limit."""

    def __init__(self, jobs: HttpJobs, registry: models_api.Registry, policy: Callable[[], Policy], *,
                 model_id: str, limits: LimitsConfig, strict: bool, read_json: Callable[[Request], Awaitable[Any]],
                 tool_format: str = "auto", reasoning_format: str = "auto"):
        self.jobs = jobs
        self.loop = jobs.loop
        self.registry = registry  # the served models by name and role: what `model` routes to
        self.policy = policy
        self.model_id = model_id
        self.limits = limits
        self.strict = strict  # [http] strict: unknown request fields refused (else ignored with a warning header)
        self.read_json = read_json
        self.tool_format = tool_format  # [target] tool_format (auto: the template's)
        self.reasoning_format = reasoning_format  # [target] reasoning_format (auto: the template's)

    # ---- the request, parsed and checked -------------------------------------------------------

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

    def _chat_request(self, body: Any, chat: bool) -> oa.CompletionRequest:
        """An OpenAI body (chat's or completions') as the chat pipeline's request."""
        return self._parse(lambda: oa.parse_request(body, chat=chat, policy=self.policy(), models=(self.model_id,),
                                                    limits=self.limits, strict=self.strict,
                                                    tool_format=self._tool_format(),
                                                    reasoning_format=self._reasoning_format()))

    def _tool_format(self) -> str:
        """The call format the model writes: [target] tool_format, or the one its chat template writes."""
        return tools_mod.call_format(self.loop.encoder, self.jobs.chat_template, self.tool_format)

    def _reasoning_format(self) -> str:
        """Whether the model thinks: [target] reasoning_format, or what its chat template writes."""
        enc = self.loop.encoder
        if self.reasoning_format != "auto" or enc is None:
            return self.reasoning_format if self.reasoning_format != "auto" else "none"
        return reasoning.format_for(chat_encoding.template_of(enc, self.jobs.chat_template or None))

    def _check_capabilities(self, req: oa.CompletionRequest, field: str) -> None:
        """What the engine must apply, checked as gRPC checks it: a constraint (`field` names where
        the request asked for one) and a reasoning budget."""
        pipe.check_capabilities(self.loop, self.limits, constraint=req.constraint, field=field,
                                budget=req.reasoning_budget if req.reasons else None,
                                budget_field="edgespec.reasoning_budget")

    def _translated(self, chat: dict, rename: Callable[[BadRequest], BadRequest]) -> oa.CompletionRequest:
        """A chat body translated from another API's (Messages, Responses) as the chat pipeline's
        request; a field error renamed as that API names the field."""
        try:
            self._route(chat.get("model"))
            return self._chat_request(chat, True)
        except BadRequest as exc:
            raise rename(exc) from None

    # ---- OpenAI's chat and completions ---------------------------------------------------------

    async def chat(self, request: Request, rid: str) -> Response:
        return await self.jobs.admitted(lambda hold, place: self._openai(request, rid, True, hold, place))

    async def completions(self, request: Request, rid: str) -> Response:
        return await self.jobs.admitted(lambda hold, place: self._openai(request, rid, False, hold, place))

    async def _openai(self, request: Request, rid: str, chat: bool, hold: contextlib.ExitStack,
                      place: Place | Unlimited) -> Response:
        body = await self.read_json(request)
        self._route(body.get("model") if isinstance(body, dict) else None)
        req = self._chat_request(body, chat)
        field = ("edgespec.constraint" if isinstance(body.get("edgespec"), dict) and
                 body["edgespec"].get("constraint") is not None else
                 "tools" if req.tools is not None and body.get("response_format") is None else "response_format")
        self._check_capabilities(req, field)
        piece: oa.Piece | None = None
        if req.logprobs is not None:
            pieces = await self.jobs.vocabulary()
            piece = lambda t: pieces[t] if 0 <= t < len(pieces) else b""
        run = await self.jobs.start(req, rid, hold, place, field)
        rid_out = ("chatcmpl-" if chat else "cmpl-") + rid
        warning = _warning_headers(req.ignored, req.unserved_model, self.model_id)
        if req.stream:
            fmt = oa.CompletionStream(req, rid=rid_out, created=run.created, model=self.model_id, n=req.n,
                                      piece=piece)
            return stream_response(self.jobs, req, run, fmt, hold, warning)
        results = await self.jobs.results(request, run.jobs)
        n_prompt = len(run.jobs[0].prompt_tokens or ())
        bodies = [oa.completion_body(req, rid=rid_out, created=run.created, model=self.model_id, result=r,
                                     prompt_tokens=n_prompt, timings=j.timings(), piece=piece or (lambda t: b""),
                                     reasoning=run.reasoning)
                  for r, j in zip(results, run.jobs)]
        return JSONResponse(bodies[0] if req.n == 1 else oa.choices_body(bodies), headers=warning)

    # ---- Anthropic's Messages API --------------------------------------------------------------

    def _anthropic(self, body: Any, *, count: bool = False) -> tuple[oa.CompletionRequest, tuple[str, ...]]:
        """A Messages body as the chat pipeline's request, and the unknown fields ignored."""
        chat, ignored, origin = an.to_chat(body, strict=self.strict, count=count)
        return self._translated(chat, lambda exc: an.renamed(exc, origin)), ignored

    async def messages(self, request: Request, rid: str) -> Response:
        return await self.jobs.admitted(lambda hold, place: self._messages(request, rid, hold, place))

    async def _messages(self, request: Request, rid: str, hold: contextlib.ExitStack,
                        place: Place | Unlimited) -> Response:
        req, ignored = self._anthropic(await self.read_json(request))
        self._check_capabilities(req, "tools")
        run = await self.jobs.start(req, rid, hold, place, "tools")
        rid_out = "msg_" + rid
        n_prompt = len(run.jobs[0].prompt_tokens or ())
        warning = _warning_headers(ignored, req.unserved_model, self.model_id)
        if req.stream:
            fmt = an.MessageStream(rid=rid_out, model=self.model_id, input_tokens=n_prompt)
            return stream_response(self.jobs, req, run, fmt, hold, warning)
        (result,) = await self.jobs.results(request, run.jobs)
        thought, content, calls, finish = _calls(req, result, run.reasoning)
        body = an.message_body(rid=rid_out, model=self.model_id, content=content, calls=calls, finish=finish,
                               thinking=thought,
                               stop_sequence=await self.jobs.stop_sequence(req, result),
                               input_tokens=result.prompt_tokens or n_prompt, output_tokens=len(result.token_ids),
                               stats=oa.speculation_stats(result, run.jobs[0].timings()))
        return JSONResponse(body, headers=warning)

    async def count_tokens(self, request: Request, rid: str) -> Response:
        req, ignored = self._anthropic(await self.read_json(request), count=True)
        tokens = await self.jobs.prompt_tokens(req)
        return JSONResponse({"input_tokens": len(tokens)},
                            headers=_warning_headers(ignored, req.unserved_model, self.model_id))

    # ---- OpenAI's Responses API ----------------------------------------------------------------

    async def responses(self, request: Request, rid: str) -> Response:
        return await self.jobs.admitted(lambda hold, place: self._responses(request, rid, hold, place))

    async def _responses(self, request: Request, rid: str, hold: contextlib.ExitStack,
                         place: Place | Unlimited) -> Response:
        body = await self.read_json(request)
        chat, ignored, origin = ra.to_chat(body, strict=self.strict)
        req = self._translated(chat, lambda exc: ra.renamed(exc, origin))
        field = "tools" if req.tools is not None and chat.get("response_format") is None else "text.format"
        self._check_capabilities(req, field)
        run = await self.jobs.start(req, rid, hold, place, field)
        base = ra.base_body(body, rid="resp_" + rid, created=run.created, model=self.model_id)
        n_prompt = len(run.jobs[0].prompt_tokens or ())
        warning = _warning_headers(ignored, req.unserved_model, self.model_id)
        if req.stream:
            return stream_response(self.jobs, req, run, ra.ResponseStream(base, prompt_tokens=n_prompt), hold,
                                   warning)
        (result,) = await self.jobs.results(request, run.jobs)
        thought, content, calls, finish = _calls(req, result, run.reasoning)
        out = ra.response_body(base, output=ra.output_items(content, calls, finish, thought), finish=finish,
                               usage=ra.usage([result], n_prompt),
                               stats=oa.speculation_stats(result, run.jobs[0].timings()))
        return JSONResponse(out, headers=warning)


__all__: Sequence[str] = ("ChatRoutes",)
