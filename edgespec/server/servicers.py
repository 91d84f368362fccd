"""Thin servicers: protobuf -> domain (convert.py) -> engine loop -> protobuf. Errors are raised
as domain exceptions and mapped to status codes by status.ServerInterceptor."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import structlog

from edgespec import chat, reasoning, tool_formats
from edgespec.errors import BadRequest, NotReady
from edgespec.logs import bind_request_id
from edgespec.proto.edgespec.v1 import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.server import convert, pipe
from edgespec.server.callers import UNLIMITED, CallerLimits, Place, Unlimited, current_caller
from edgespec.server.config import LimitsConfig
from edgespec.server.engine_loop import EngineLoop, Job
from edgespec.server.policy import Policy, check_ignore_eos
from edgespec.tools import call_format, encode_request
from edgespec.types import GenerationResult

POLL_SECONDS = pipe.POLL_SECONDS


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Every request is checked against the [limits] and tokenised here, in the handler thread:
    the engine thread receives token ids and never spends its time on a caller's text."""

    def __init__(self, loop: EngineLoop, policy: Callable[[], Policy], *, parallel: int,
                 limits: LimitsConfig = convert.DEFAULT_LIMITS,
                 digests: Callable[[], dict[str, tuple[str, str]]] = dict, chat_template: str = "",
                 tool_format: str = "auto", reasoning_format: str = "auto", embedder: Any = None,
                 callers: CallerLimits | None = None, registry: Any = None, reranker: Any = None,
                 record: Callable[[str, str, int, float], None] | None = None):
        from edgespec.server.models_api import build_registry

        self.loop = loop
        # the served models by name and role (models_api.Registry); the reranker, None when [rerank] is off
        self.registry = registry or build_registry("target", embedder.cfg if embedder is not None else None)
        self.reranker = reranker
        self.record = record or (lambda model, role, items, seconds: None)
        self.callers = callers  # per-caller limits and figures (shared with HTTP), None: no limits
        self.embedder = embedder  # an edgespec.server.embeddings.Embedder, None when [embedding] is off
        self.chat_template = chat_template  # [target] chat_template's text ("" = the GGUF's own)
        self.tool_format = tool_format  # [target] tool_format (auto: the template's)
        self.reasoning_format = reasoning_format  # [target] reasoning_format (auto: the template's)
        self.policy = policy
        self.parallel = parallel
        self.limits = limits
        self.digests = digests  # role -> (manifest name, sha256) of the loaded models

    # ---- helpers -------------------------------------------------------------------------

    def _reasons(self, messages: tuple) -> bool:
        """Whether the model writes a <think> block: [target] reasoning_format, or its template's."""
        if not messages:
            return False
        if self.reasoning_format != "auto":
            return self.reasoning_format == "think"
        enc = self.loop.encoder
        return enc is not None and reasoning.format_for(chat.template_of(enc, self.chat_template or None)) == "think"

    def _submit(self, request: pb.GenerateRequest, context: grpc.ServicerContext, place: Place | Unlimited
                ) -> tuple[Job, reasoning.Reasoning | None]:
        """The request's job, submitted; and its reasoning (None: the model does not think)."""
        rid = (pipe.request_id(request.request_id, "request_id")
               or structlog.contextvars.get_contextvars().get("x_request_id") or uuid.uuid4().hex[:16])
        bind_request_id(request_id=rid)
        if request.model:  # another role's name, or one not served: refused by name
            self.registry.pick("chat", request.model)
        policy = self.policy()
        prompt, messages = convert.prompt_from(request, self.limits)
        sampling = convert.sampling_from(request.sampling, policy, self.limits)
        speculation = convert.speculation_from(request.speculation, policy)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None and remaining < 1e8 else None
        constraint, logprobs = convert.constraint_from(request.sampling), convert.logprobs_from(request)
        spec, extras = convert.tools_from(request), convert.message_extras(request.messages)
        if spec is not None:
            spec = dataclasses.replace(spec, format=call_format(self.loop.encoder, self.chat_template,
                                                                self.tool_format))
            if (bad := tool_formats.check_strings(tool_formats.by_name(spec.format), spec.tools)) is not None:
                where, why = bad  # tools[i].function.parameters.<path>: named as this API names it
                i = where[where.index("[") + 1:where.index("]")]
                raise BadRequest(f"tools.tools[{i}].parameters_json", f"{where.split('.parameters.', 1)[1]}: {why}")
            if constraint is not None and spec.calls_allowed:
                raise BadRequest("sampling.constraint", "cannot be combined with tools unless tools.choice is none")
            constraint = constraint or spec.constraint()
        check_ignore_eos(sampling, constraint is not None, "sampling.ignore_eos")
        field = "tools" if spec is not None else "sampling.constraint"
        variables, budget = convert.reasoning_from(request)
        reasons = self._reasons(messages)
        pipe.check_capabilities(self.loop, self.limits, constraint=constraint, field=field,
                                value_field=field if spec is not None else f"{field}.value",
                                budget=budget if reasons else None, budget_field="reasoning.budget_tokens")
        rendered: list[str] = []
        tokens = pipe.prompt_tokens(self.loop, self.chat_template, prompt, messages, extras, spec,
                                    variables=variables, jinja=reasons, rendered=rendered)
        thinking = reasoning.Reasoning(bool(rendered) and reasoning.opened(rendered[-1]), budget) if reasons else None
        if thinking is not None and (constraint is not None or budget is not None):
            # the constraint holds after the reasoning; the budget on it (edgespec/budget.py)
            calls = spec is not None and spec.calls_allowed
            constraint = thinking.constraint(spec.constraint((reasoning.OPEN,)) if calls and spec else constraint)
        matcher = self.loop.compile(constraint)  # here, in this handler's thread: not the engine's
        place.reserve(len(tokens) + sampling.max_tokens)  # in flight: counted at admission
        job = Job(request_id=rid, sampling=sampling, speculation=speculation, prompt=prompt,
                  messages=messages, prompt_tokens=tokens, deadline=deadline, logprobs=logprobs,
                  constraint=constraint, matcher=matcher, constraint_field=field, tools=spec, caller=structlog.contextvars.get_contextvars().get("caller", ""),
                  place=place)
        self.loop.submit(job)
        context.add_callback(job.cancel)  # client cancel / deadline / server stop -> engine stops within a step
        return job, thinking

    def _events(self, job: Job) -> Iterator[tuple[str, Any]]:
        """("chunk", Chunk) ... ("result", GenerationResult); raises the job's error (pipe.job_events)."""
        return pipe.job_events(job.events, stopped=lambda: self.loop.stopped, poll=POLL_SECONDS)

    @staticmethod
    def _check_end(result: GenerationResult) -> None:
        # an engine failure stays in the answer (FinishReason ERROR), as the API documents
        pipe.check_end(result, deadline="deadline exceeded", failed=False)

    # ---- RPCs ----------------------------------------------------------------------------

    def _admit(self, queued: bool = True) -> Any:
        """The caller's own place for this request ([limits] caller_*): a callers.Place."""
        if self.callers is None:
            return contextlib.nullcontext(UNLIMITED)
        return self.callers.admit(current_caller(), queued=queued)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        with self._admit() as place:
            return self._generate(request, context, place)

    def _generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext,
                  place: Place | Unlimited) -> pb.GenerateResponse:
        job, thinking = self._submit(request, context, place)  # the engine charges what it cost as it ends
        for kind, value in self._events(job):
            if kind == "result":
                self._check_end(value)
                thought, text = thinking.split(value.text) if thinking is not None else (None, value.text)
                return convert.response(value, text=text, token_ids=value.token_ids,
                                        timings=job.timings(), request_id=job.request_id,
                                        prompt_tokens=len(job.prompt_tokens or ()),
                                        logprobs=value.logprobs if job.logprobs is not None else (),
                                        tool_calls=self._calls(job, value, text), reasoning=thought or "")
        raise NotReady("the engine stopped")  # pragma: no cover

    def GenerateStream(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        with self._admit() as place:
            yield from self._generate_stream(request, context, place)

    def _generate_stream(self, request: pb.GenerateRequest, context: grpc.ServicerContext,
                         place: Place | Unlimited) -> Iterator[pb.GenerateResponse]:
        job, thinking = self._submit(request, context, place)  # the engine charges what it cost as it ends
        split = reasoning.ReasoningSplitter(thinking.opened) if thinking is not None else None
        held = None  # the finishing chunk is merged into the final message
        for kind, value in self._events(job):
            if kind == "chunk":
                if value.finish_reason:
                    held = value
                elif value.token_ids or value.text:
                    thought, text = _parts(split.feed(value.text)) if split is not None else ("", value.text)
                    yield convert.response(None, text=text, token_ids=value.token_ids, timings=None,
                                           request_id=job.request_id, logprobs=value.logprobs, reasoning=thought)
            else:
                self._check_end(value)
                thought, text = _parts(split.feed(held.text if held else "") + split.finish()) \
                    if split is not None else ("", held.text if held else "")
                content = thinking.split(value.text)[1] if thinking is not None else value.text
                yield convert.response(value, text=text, token_ids=held.token_ids if held else (),
                                       timings=job.timings(), request_id=job.request_id,
                                       prompt_tokens=len(job.prompt_tokens or ()), logprobs=held.logprobs if held else (),
                                       tool_calls=self._calls(job, value, content), reasoning=thought)

    @staticmethod
    def _calls(job: Job, result: GenerationResult, content: str) -> tuple:
        """The calls in the answer's content (its reasoning split off)."""
        spec = job.tools
        if spec is None or not spec.calls_allowed:
            return ()
        return spec.parse(content, truncated=result.finish_reason == "length")[1]

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        if request.text and request.messages:
            raise BadRequest("text", "set either text or messages, not both")
        messages = convert.messages_from(request.messages, limits=self.limits)
        text = convert.text_within(request.text, "text", self.limits)

        def encode(tok: Any) -> list[int]:
            if messages and self.chat_template:  # [target] chat_template, as a generate request renders it
                return encode_request(tok, text, messages, (), None, self.chat_template)
            return chat.encode_prompt(tok, text, messages, add_special=request.add_special,
                                      parse_special=request.parse_special)

        ids = encode(pipe.encoder(self.loop))
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    def Embed(self, request: pb.EmbedRequest, context: grpc.ServicerContext) -> pb.EmbedResponse:
        from edgespec.server import embeddings as emb

        if self.embedder is None:
            raise BadRequest("texts", "embeddings are off on this server ([embedding] enabled = false)")
        if request.texts and request.token_inputs:
            raise BadRequest("texts", "set either texts or token_inputs, not both")
        items = list(request.texts) or [list(t.ids) for t in request.token_inputs]
        if not items:
            raise BadRequest("texts", "one of texts or token_inputs is required")
        req = emb.parse_request({"input": items}, models=None, max_inputs=self.embedder.cfg.max_inputs,
                                max_bytes=self.limits.max_prompt_bytes)
        served = self.registry.pick("embedding", request.model)
        started = time.monotonic()
        with self._admit(queued=False) as place:  # runs at once, outside the engine's slots
            vectors, n = self.embedder.embed(req.inputs)
            place.used(n)
        self.record(served.id, "embedding", len(req.inputs), time.monotonic() - started)
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=v.tolist()) for v in vectors], prompt_tokens=n,
                                model=served.id)

    def Rerank(self, request: pb.RerankRequest, context: grpc.ServicerContext) -> pb.RerankResponse:
        from edgespec.errors import UnknownModel
        from edgespec.server import rerank as rr

        if self.reranker is None:
            raise UnknownModel("model", "reranking is off on this server ([rerank] enabled = false)")
        body: dict[str, Any] = {"query": request.query, "documents": list(request.documents),
                                "return_documents": request.return_documents}
        if request.top_n:
            body["top_n"] = request.top_n
        if request.max_tokens_per_doc:
            body["max_tokens_per_doc"] = request.max_tokens_per_doc
        req = rr.parse_request(body, max_documents=self.reranker.cfg.max_documents,
                               max_bytes=self.limits.max_prompt_bytes)
        served = self.registry.pick("rerank", request.model)
        started = time.monotonic()
        with self._admit(queued=False) as place:  # runs at once, outside the engine's slots
            scores, n = self.reranker.score(req.query, req.documents, req.max_tokens_per_doc)
            place.used(n)
        self.record(served.id, "rerank", len(req.documents), time.monotonic() - started)
        return pb.RerankResponse(results=[pb.RerankResult(index=i, relevance_score=scores[i],
                                                          document=req.documents[i] if req.return_documents else "")
                                          for i in rr.ranked(scores, req.top_n)],
                                 prompt_tokens=n, model=served.id)

    def ListModels(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ServedModel(id=m["id"], role=m["role"], kind=m.get("kind", ""))
                                             for m in self.registry.listing()])

    def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfoResponse:
        info = dict(self.loop.call(lambda engine: engine.model_info()))
        target, draft = info.pop("target", None) or {}, info.pop("draft", None) or {}
        head = info.pop("head", None) or {}  # an EAGLE-3 head beside the draft model ([draft] head)
        out = pb.ModelInfoResponse(
            target_path=str(target.get("path", "")),
            draft_path=str(draft.get("path", "")),
            n_ctx=int(info.pop("n_ctx", 0) or 0),
            vocab_size=int(info.pop("n_vocab", 0) or 0),
            backend=str(info.pop("backend", "")),
            parallel=int(info.pop("parallel", self.parallel) or self.parallel),
        )
        digests = self.digests()
        out.target_name, out.target_sha256 = digests.get("target", ("", ""))
        out.draft_name, out.draft_sha256 = digests.get("draft", ("", ""))
        if head:
            out.details["head.path"] = str(head.get("path", ""))
            name, sha = digests.get("head", ("", ""))
            out.details["head.name"], out.details["head.sha256"] = name, sha
        for prefix, d in (("target", target), ("draft", draft), ("head", head)):
            for key, value in d.items():
                if key != "path":
                    out.details[f"{prefix}.{key}"] = str(value)
        for key, value in info.items():
            out.details[str(key)] = str(value)
        return out


def _parts(events: list[tuple[str, str]]) -> tuple[str, str]:
    """ReasoningSplitter's events as (the reasoning, the content) they hold."""
    return "".join(v for k, v in events if k == "reasoning"), "".join(v for k, v in events if k == "content")


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, loop: EngineLoop, policy: Callable[[], Policy],
                 update_policy: Callable[[dict[str, object], bool], Policy],
                 drain: Callable[[bool], None], started: float, last_reload: Callable[[], dict | None] = lambda: None,
                 callers: CallerLimits | None = None,
                 clear_suffix: Callable[[str], Callable[[], None]] | None = None):
        self.loop = loop
        # SetPolicy clear_suffix_cache: (chat model name, "" = every one) -> what empties its cache;
        # the name is resolved (NOT_FOUND) before anything changes
        self.clear_suffix = clear_suffix or (
            lambda model: lambda: loop.call(lambda engine: engine.suffix_control(clear=True)))
        self.callers = callers
        self.policy = policy
        self.update_policy = update_policy  # (admin overrides, reset first) -> the policy now in force
        self.drain = drain
        self.started = started
        self.last_reload = last_reload

    def Stats(self, request: admin_pb2.StatsRequest, context: grpc.ServicerContext) -> admin_pb2.StatsResponse:
        s = self.loop.stats()
        out = admin_pb2.StatsResponse(
            active_requests=s["active_requests"], queue_depth=s["queue_depth"], queue_capacity=s["queue_capacity"],
            parallel=s["parallel"], ready=s["ready"], draining=s["draining"],
            uptime_seconds=time.monotonic() - self.started, requests_total=s.get("requests_total", 0),
            rejected_overloaded_total=s.get("rejected_overloaded_total", 0),
            generated_tokens_total=s.get("generated_tokens_total", 0),
            target_forwards_total=s.get("target_forwards_total", 0),
            drafted_tokens_total=s.get("drafted_tokens_total", 0),
            accepted_tokens_total=s.get("accepted_tokens_total", 0),
            breaker_transitions_total=s.get("breaker_transitions_total", 0),
            policy=convert.policy_to_pb(self.policy()),
        )
        if (r := self.last_reload()) is not None:
            out.last_reload.CopyFrom(admin_pb2.LastReload(**r))
        for key, value in s.items():
            if key.startswith("finished_"):
                out.finished_by_reason[key[len("finished_"):]] = value
        ticks = dict(s.get("tick_totals") or {})
        out.ticks_total = int(ticks.pop("ticks", 0))
        out.idle = bool(s.get("idle", False))
        for key, value in ticks.items():
            out.tick_totals[key] = float(value)
        for key, value in (s.get("suffix_cache") or {}).items():
            out.suffix_cache[key] = float(value)
        for field in ("proposed_by_source", "accepted_by_source"):
            for key, value in (s.get(field) or {}).items():
                getattr(out, field)[key] = int(value)
        for who, f in (self.callers.snapshot() if self.callers is not None else {}).items():
            out.callers[who].CopyFrom(admin_pb2.CallerFigures(
                requests_total=f["requests"], rejected_total=f["rejected"], tokens_total=f["tokens"],
                in_flight=f["in_flight"], running=f["running"], queued=f["queued"],
                rejected_by_reason=f["rejected_by_reason"]))
        return out

    def SetPolicy(self, request: admin_pb2.SetPolicyRequest, context: grpc.ServicerContext) -> admin_pb2.Policy:
        clear = self.clear_suffix(request.model) if request.clear_suffix_cache else None
        policy = self.update_policy(convert.policy_changes(request), request.reset)
        if clear is not None:
            clear()
        return convert.policy_to_pb(policy)

    def Drain(self, request: admin_pb2.DrainRequest, context: grpc.ServicerContext) -> admin_pb2.DrainResponse:
        self.drain(not request.resume)
        s = self.loop.stats()
        return admin_pb2.DrainResponse(draining=s["draining"], active_requests=s["active_requests"],
                                       queue_depth=s["queue_depth"])
