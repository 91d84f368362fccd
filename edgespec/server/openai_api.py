"""OpenAI-style JSON <-> domain types: request validation (every field named in the error, as
OpenAI's `param`) and the response / stream-chunk bodies. Pure: no I/O, no server, no engine.

Supported: model, messages (text content; an assistant turn's tool_calls, a tool turn's
tool_call_id), prompt (one string), max_tokens / max_completion_tokens, temperature, top_p,
top_k, min_p, seed, stop, n (1-8; a stream interleaves the choices' chunks), stream,
stream_options.include_usage, logprobs / top_logprobs, response_format (text, json_object,
json_schema), tools / tool_choice / parallel_tool_calls (edgespec.tools), user (ignored), and the `edgespec` extension object: mode,
draft_tokens, tree_nodes, tree_depth, ngram, timeout_seconds, constraint {kind, value}; and
presence_penalty, frequency_penalty, repetition_penalty and logit_bias (exact under speculation:
edgespec.penalties); ignore_eos (vLLM's and llama-server's: end-of-generation tokens are banned,
the answer runs to max_tokens; refused with a constraint).
Refused with a 400 naming the field: functions, function_call, audio, modalities, prediction, suffix, echo,
best_of > 1, non-text message parts, token-id prompts; unknown fields and a model this server
does not serve only under [http] strict = true (else the fields are ignored and the served model
answers, both named back to the caller).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edgespec import reasoning as reasoning_mod
from edgespec import tools as tools_mod
from edgespec.errors import BadRequest
from edgespec.sampling import SamplingParams
from edgespec.server import answer
from edgespec.server.config import LimitsConfig
from edgespec.server.policy import Policy, check_ignore_eos, sampling_for, speculation_for
from edgespec.settings import SAMPLING, SPECULATION, Setting, check_fields, check_stop
from edgespec.types import MAX_TOP_LOGPROBS, ConstraintSpec, GenerationResult, SpeculationParams, TokenLogprob

ROLES = ("system", "user", "assistant", "tool", "developer")
DEFAULT_LIMITS = LimitsConfig()
# OpenAI's default temperature: a caller that leaves it out samples, as it would from OpenAI
DEFAULT_TEMPERATURE = 1.0
MAX_TIMEOUT_SECONDS = 24 * 3600.0
MAX_CHOICES = 8  # n: each choice is a request of its own in the engine (a slot, a place in the caller's limit)
TIMEOUT = Setting("edgespec", "timeout_seconds", (int, float), None, "the request's deadline",
                  lo=0, lo_open=True, hi=MAX_TIMEOUT_SECONDS)
_MODES = {"auto": "auto", "off": "plain", "plain": "plain", "chain": "chain", "tree": "tree"}
# fields OpenAI defines that we do not implement: refused unless absent, null or neutral
_REFUSED = ("functions", "function_call", "audio", "modalities", "prediction", "suffix", "web_search_options")
_NEUTRAL = {"echo": False, "best_of": 1, "store": False}
_KNOWN = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs", "response_format",
          "user", "metadata", "edgespec", "service_tier", "reasoning_effort", "tools", "tool_choice",
          "parallel_tool_calls", "chat_template_kwargs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
          "ignore_eos", *_REFUSED, *_NEUTRAL}


@dataclass(frozen=True)
class CompletionRequest:
    """A validated /v1/chat/completions or /v1/completions body."""

    chat: bool
    model: str
    prompt: str
    messages: tuple[tuple[str, str], ...]
    sampling: SamplingParams
    speculation: SpeculationParams
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: none; k: the token's logprob and k alternatives
    constraint: ConstraintSpec | None = None
    timeout_seconds: float | None = None
    tools: tools_mod.ToolSpec | None = None
    # per message: what the chat template reads besides role and content (an assistant turn's
    # tool_calls: tuple[ToolCall], a tool turn's tool_call_id); empty when no message has any
    extras: tuple[Mapping[str, Any], ...] = ()
    ignored: tuple[str, ...] = ()  # unknown fields ignored under [http] strict = false
    # a model named that this server does not serve, answered by the one it serves ([http] strict = false)
    unserved_model: str = ""
    n: int = 1  # choices: independent samples of one prompt (seed + i each when a seed is set)
    # what the chat template is given besides the conversation (enable_thinking, reasoning_effort)
    template_vars: tuple[tuple[str, Any], ...] = ()
    reasons: bool = False  # the model writes a <think> block, split from the content (edgespec.reasoning)
    # the most tokens its <think> block may take (edgespec.reasoning_budget, or reasoning_effort's: EFFORT_BUDGETS)
    reasoning_budget: int | None = None

    @property
    def parses_calls(self) -> bool:
        """The answer may be tool calls (parsed into message.tool_calls)."""
        return self.chat and self.tools is not None and self.tools.calls_allowed


# ---- validation helpers ------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: Mapping, name: str, lo: int, hi: int, default: Any = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise BadRequest(name, f"must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _bool(body: Mapping, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(name, f"must be true or false, got {v!r}")
    return v


def _str(v: Any, name: str) -> str:
    """A string that is valid Unicode text (JSON's \\ud800 escapes can make lone surrogates)."""
    if not isinstance(v, str):
        raise BadRequest(name, f"must be a string, got {type(v).__name__}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(name, "must be valid Unicode text (a lone surrogate escape?)") from None
    return v


def _stop(v: Any, limits: LimitsConfig) -> tuple[str, ...]:
    """A string or a list of strings; their count and lengths are checked with the other
    sampling fields (policy.sampling_for)."""
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list):
        raise BadRequest("stop", "must be a string or a list of strings")
    # its count, then each string's length, before any of them is looked at further
    check_stop(stops, max_strings=limits.max_stop_strings, max_chars=limits.max_stop_chars)
    for i, s in enumerate(stops):
        _str(s, f"stop[{i}]")
    return tuple(stops)


def _content(v: Any, name: str) -> str:
    """A message's content: a string or a list of {"type": "text", "text": ...} parts."""
    if v is None:
        return ""
    if isinstance(v, str):
        return _str(v, name)
    if not isinstance(v, list):
        raise BadRequest(name, "must be a string or a list of text parts")
    out = []
    for j, part in enumerate(v):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise BadRequest(f"{name}[{j}].type", f"only text parts are supported, got {kind!r}")
        out.append(_str(part.get("text"), f"{name}[{j}].text"))
    return "".join(out)


def _messages(v: Any, limits: LimitsConfig = DEFAULT_LIMITS) -> tuple[tuple[str, str], ...]:
    return _turns(v, limits)[0]


def _turns(v: Any, limits: LimitsConfig = DEFAULT_LIMITS) -> tuple[tuple[tuple[str, str], ...],
                                                                   tuple[Mapping[str, Any], ...]]:
    """(messages, extras): checked before any of it is looked at further: the count, then each
    message, with the contents' total size bounded as it goes. extras: per message, an assistant
    turn's tool_calls and reasoning_content, a tool turn's tool_call_id (empty when no message
    has any)."""
    if not isinstance(v, list) or not v:
        raise BadRequest("messages", "must be a non-empty list of {role, content} objects")
    if len(v) > limits.max_messages:
        raise BadRequest("messages", f"at most {limits.max_messages} messages (limits.max_messages), got {len(v)}")
    out = []
    extras: list[Mapping[str, Any]] = []
    size = 0
    for i, m in enumerate(v):
        if not isinstance(m, Mapping):
            raise BadRequest(f"messages[{i}]", "must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        extra: dict[str, Any] = {}
        if m.get("tool_calls"):
            if role != "assistant":
                raise BadRequest(f"messages[{i}].tool_calls", "only assistant messages carry tool calls")
            extra["tool_calls"] = tools_mod.parse_history_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            size += sum(len(c.arguments.encode("utf-8")) + len(c.name) for c in extra["tool_calls"])
        if role == "tool" and m.get("tool_call_id") is not None:
            extra["tool_call_id"] = _str(m["tool_call_id"], f"messages[{i}].tool_call_id")
        if role == "assistant" and m.get("reasoning_content"):  # llama-server's and vLLM's field
            extra["reasoning_content"] = _str(m["reasoning_content"], f"messages[{i}].reasoning_content")
            size += len(extra["reasoning_content"].encode("utf-8"))
        content = _content(m.get("content"), f"messages[{i}].content")
        size += len(content.encode("utf-8"))
        if size > limits.max_prompt_bytes:
            raise BadRequest(f"messages[{i}].content", f"the messages' contents together at most "
                             f"{limits.max_prompt_bytes} bytes (limits.max_prompt_bytes)")
        out.append(("system" if role == "developer" else role, content))
        extras.append(extra)
    return tuple(out), (tuple(extras) if any(extras) else ())


def _prompt(v: Any, limits: LimitsConfig = DEFAULT_LIMITS) -> str:
    if isinstance(v, list):
        if len(v) == 1 and isinstance(v[0], str):
            v = v[0]
        elif v and (all(_is_int(t) for t in v) or isinstance(v[0], list)):
            raise BadRequest("prompt", "token-id prompts are not supported; send the text")
        else:
            raise BadRequest("prompt", f"one prompt per request (n = 1), got a list of {len(v)}")
    if not isinstance(v, str) or not v:
        raise BadRequest("prompt", "must be a non-empty string")
    n = len(_str(v, "prompt").encode("utf-8"))
    if n > limits.max_prompt_bytes:
        raise BadRequest("prompt", f"at most {limits.max_prompt_bytes} bytes (limits.max_prompt_bytes), got {n}")
    return v


def _response_format(v: Any) -> ConstraintSpec | None:
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise BadRequest("response_format", "must be an object with a type")
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object")
    if kind == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, Mapping):
            raise BadRequest("response_format.json_schema", "must be an object with a schema")
        schema = js.get("schema")
        if not isinstance(schema, Mapping):
            raise BadRequest("response_format.json_schema.schema", "must be a JSON schema object")
        return ConstraintSpec("json_schema", json.dumps(schema))
    raise BadRequest("response_format.type", f"must be one of text, json_object, json_schema, got {kind!r}")


def _speculation(ext: Mapping, policy: Policy) -> SpeculationParams:
    mode = ext.get("mode", "auto")
    if mode not in _MODES:
        raise BadRequest("edgespec.mode", f"must be one of {', '.join(_MODES)}, got {mode!r}")
    return speculation_for(policy, _MODES[mode], {k: ext.get(k) for k in SPECULATION}, ext.get("ngram"),
                           prefix="edgespec.")


def _extension(v: Any) -> Mapping:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise BadRequest("edgespec", "must be an object (mode, draft_tokens, tree_nodes, tree_depth, ngram, "
                                     "timeout_seconds, constraint, reasoning_budget)")
    known = {"mode", "draft_tokens", "tree_nodes", "tree_depth", "ngram", "timeout_seconds", "constraint",
             "reasoning_budget"}
    for k in v:
        if k not in known:
            raise BadRequest(f"edgespec.{k}", f"unknown field (known: {', '.join(sorted(known))})")
    return v


# ---- the request -------------------------------------------------------------------------------


def parse_request(body: Any, *, chat: bool, policy: Policy, models: Sequence[str],
                  limits: LimitsConfig = DEFAULT_LIMITS, strict: bool = True,
                  tool_format: str = "hermes", reasoning_format: str = "none") -> CompletionRequest:
    """Validate a request body; BadRequest(field) names the first offending field. `tool_format`:
    the call format the model writes (tools.call_format); `reasoning_format`: whether it writes
    a <think> block (edgespec.reasoning)."""
    if not isinstance(body, Mapping):
        raise BadRequest("body", "must be a JSON object")
    ignored = _refuse_unsupported(body, strict)
    if ignored:
        body = {k: v for k, v in body.items() if k not in ignored}
    model = _str(body.get("model"), "model") if body.get("model") is not None else ""
    unserved = ""
    if model and model not in models:
        if strict:
            raise BadRequest("model", f"unknown model {model!r} (served: {', '.join(models)})")
        unserved = model
    messages, extras, prompt = _input(body, chat, limits)
    tools = tools_mod.parse_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"),
                                  tool_format) if chat else None
    if not chat:
        for k in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(k) is not None:
                raise BadRequest(k, "is for chat completions (/v1/chat/completions)")
    n = body.get("n")
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise BadRequest("n", f"must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    sampling = _sampling(body, policy, limits)
    stream, include_usage = _stream(body)
    logprobs = _logprobs(body, chat)
    ext = _extension(body.get("edgespec"))
    constraint = _constraint(body.get("response_format"), ext.get("constraint"))
    if tools is not None:
        if constraint is not None and tools.calls_allowed:
            raise BadRequest("response_format" if body.get("response_format") is not None else "edgespec.constraint",
                             "cannot be combined with tools unless tool_choice is none")
        if constraint is None:
            constraint = tools.constraint()
    check_ignore_eos(sampling, constraint is not None, "ignore_eos")
    check_fields({"timeout_seconds": ext.get("timeout_seconds")}, {"timeout_seconds": TIMEOUT}, prefix="edgespec.")
    timeout = None if ext.get("timeout_seconds") is None else float(ext["timeout_seconds"])
    return CompletionRequest(chat=chat, model=model, prompt=prompt, messages=messages, sampling=sampling,
                             speculation=_speculation(ext, policy), stream=stream, include_usage=include_usage,
                             logprobs=logprobs, constraint=constraint, timeout_seconds=timeout, tools=tools,
                             extras=extras, ignored=ignored, n=n, unserved_model=unserved,
                             template_vars=_template_vars(body) if chat else (),
                             reasons=chat and reasoning_format == "think",
                             reasoning_budget=_reasoning_budget(body, ext) if chat else None)


EFFORTS = reasoning_mod.EFFORTS
EFFORT_BUDGETS = reasoning_mod.EFFORT_BUDGETS  # reasoning_effort -> the <think> block's budget


def _reasoning_budget(body: Mapping, ext: Mapping) -> int | None:
    """edgespec.reasoning_budget (an integer >= 1), else reasoning_effort's (EFFORT_BUDGETS)."""
    v = ext.get("reasoning_budget")
    if v is None:
        return EFFORT_BUDGETS.get(body.get("reasoning_effort"))  # type: ignore[arg-type]
    if not _is_int(v) or v < 1:
        raise BadRequest("edgespec.reasoning_budget", f"must be an integer >= 1, got {v!r}")
    return v
_TEMPLATE_VARS = {"enable_thinking": bool, "thinking": bool, "reasoning_effort": str}


def _template_vars(body: Mapping) -> tuple[tuple[str, Any], ...]:
    """reasoning_effort and chat_template_kwargs (vLLM's and llama-server's) as the chat template's
    variables: reasoning_effort as it is, and "none" as enable_thinking false too."""
    out: dict[str, Any] = {}
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise BadRequest("reasoning_effort", f"must be one of {', '.join(EFFORTS)}, got {effort!r}")
        out["reasoning_effort"] = effort
        if effort == "none":
            out["enable_thinking"] = False
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if not isinstance(kw, Mapping):
            raise BadRequest("chat_template_kwargs", "must be an object")
        for k, v in kw.items():
            kind = _TEMPLATE_VARS.get(k)
            if kind is None:
                raise BadRequest(f"chat_template_kwargs.{k}", f"unknown (known: {', '.join(_TEMPLATE_VARS)})")
            if not isinstance(v, kind):
                raise BadRequest(f"chat_template_kwargs.{k}", f"must be a {kind.__name__}, got {v!r}")
            out[k] = v
    return tuple(sorted(out.items()))


def _refuse_unsupported(body: Mapping, strict: bool = True) -> tuple[str, ...]:
    """Unknown fields (refused when `strict`, else returned: the ignored ones), and the fields
    OpenAI defines that we do not implement unless neutral."""
    unknown = tuple(str(k) for k in body if k not in _KNOWN)
    if unknown and strict:
        raise BadRequest(unknown[0], "unknown field ([http] strict = true)")
    for k in _REFUSED:
        if body.get(k) not in (None, [], {}):
            raise BadRequest(k, "is not supported by this server")
    for k, neutral in _NEUTRAL.items():
        if body.get(k) is not None and body.get(k) != neutral:
            raise BadRequest(k, f"is not supported by this server (only {json.dumps(neutral)})")
    return unknown


def _input(body: Mapping, chat: bool, limits: LimitsConfig) -> tuple[tuple[tuple[str, str], ...],
                                                                      tuple[Mapping[str, Any], ...], str]:
    """(messages, extras, prompt): chat completions take messages, completions one prompt."""
    if chat:
        if body.get("prompt") is not None:
            raise BadRequest("prompt", "chat completions take messages, not prompt")
        return (*_turns(body.get("messages"), limits), "")
    if body.get("messages") is not None:
        raise BadRequest("messages", "completions take prompt, not messages (use /v1/chat/completions)")
    return (), (), _prompt(body.get("prompt"), limits)


def _sampling(body: Mapping, policy: Policy, limits: LimitsConfig) -> SamplingParams:
    """The sampling fields, checked with gRPC's (policy.sampling_for); max_completion_tokens
    wins over max_tokens; top_k -1 is off, as in vLLM; an unset temperature is OpenAI's 1."""
    lengths = {k: body.get(k) for k in ("max_completion_tokens", "max_tokens")}
    check_fields(lengths, dict.fromkeys(lengths, SAMPLING["max_tokens"]), caps={k: policy.max_tokens for k in lengths})
    values = {k: body.get(k) for k in SAMPLING}
    values["max_tokens"] = next((v for v in lengths.values() if v is not None), None)
    values["logit_bias"] = body.get("logit_bias")
    if values["top_k"] == -1:
        values["top_k"] = 0
    return sampling_for(policy, limits, {**values, "stop": _stop(body.get("stop"), limits)},
                        temperature=DEFAULT_TEMPERATURE)


def _stream(body: Mapping) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage)."""
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is None:
        return stream, False
    if not isinstance(so, Mapping):
        raise BadRequest("stream_options", "must be an object")
    if not stream:
        raise BadRequest("stream_options", "is only allowed with stream: true")
    return stream, _bool(so, "include_usage")


def _logprobs(body: Mapping, chat: bool) -> int | None:
    """None: no logprobs; k: each token's logprob and its k best alternatives (chat: logprobs +
    top_logprobs; completions: logprobs: <count>)."""
    if chat:
        want = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and not want:
            raise BadRequest("top_logprobs", "needs logprobs: true")
        return (top or 0) if want else None
    if body.get("top_logprobs") is not None:
        raise BadRequest("top_logprobs", "completions take logprobs: <count> instead")
    return _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)


def _constraint(response_format: Any, c: Any) -> ConstraintSpec | None:
    """response_format, or the edgespec.constraint extension {kind, value}; not both."""
    constraint = _response_format(response_format)
    if c is None:
        return constraint
    if constraint is not None:
        raise BadRequest("edgespec.constraint", "set either response_format or edgespec.constraint, not both")
    if not isinstance(c, Mapping):
        raise BadRequest("edgespec.constraint", "must be an object {kind, value}")
    value = c.get("value", "")
    if not isinstance(value, str):
        raise BadRequest("edgespec.constraint.value", "must be a string")
    try:
        return ConstraintSpec(c.get("kind"), value)  # type: ignore[arg-type]
    except BadRequest as exc:
        raise BadRequest(f"edgespec.{exc.field}", str(exc).split(": ", 1)[-1]) from None


# ---- responses ---------------------------------------------------------------------------------


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's names: stop (stop string or end of sequence), length (max_tokens), tool_calls
    (the answer is tool calls)."""
    if reason is None:
        return None
    return reason if reason in ("length", "tool_calls") else "stop"


def usage(result: GenerationResult, prompt_tokens: int) -> dict:
    p = result.prompt_tokens or prompt_tokens
    c = len(result.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": result.stats.cached_prompt_tokens}}


def speculation_stats(result: GenerationResult, timings: Mapping[str, float] | None) -> dict:
    """The `edgespec` object of a response: speculation statistics and timings."""
    st = result.stats
    out = {k: v for k, v in st.as_dict().items()
           if k in ("target_forwards", "draft_forwards", "drafted_tokens", "accepted_tokens", "tau",
                    "accepted_per_depth", "steps_per_mode", "breaker_transitions", "draft_cached_tokens")}
    if timings:
        out["timings"] = {**{k: round(v, 6) for k, v in timings.items()},
                          "verify_seconds": round(st.target_seconds, 6), "draft_seconds": round(st.draft_seconds, 6)}
    return out


Piece = Callable[[int], bytes]  # token id -> the bytes it renders as


def _lp(lp: float) -> float:
    return lp if math.isfinite(lp) else -9999.0  # JSON has no -inf; OpenAI's floor


def chat_logprobs(items: Sequence[TokenLogprob], piece: Piece) -> dict:
    def one(token: int, logprob: float) -> dict:
        b = piece(token)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": _lp(logprob), "bytes": list(b)}

    return {"content": [{**one(it.token, it.logprob), "top_logprobs": [one(t, lp) for t, lp in it.top]}
                        for it in items]}


def completion_logprobs(items: Sequence[TokenLogprob], piece: Piece, offset: int = 0) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    for it in items:
        text = piece(it.token).decode("utf-8", errors="replace")
        tokens.append(text)
        lps.append(_lp(it.logprob))
        tops.append({piece(t).decode("utf-8", errors="replace"): _lp(lp) for t, lp in it.top})
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def completion_body(req: CompletionRequest, *, rid: str, created: int, model: str, result: GenerationResult,
                    prompt_tokens: int, timings: Mapping[str, float] | None, piece: Piece,
                    reasoning: reasoning_mod.Reasoning | None = None) -> dict:
    """`reasoning`: the answer's <think> block goes to message.reasoning_content."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(result.finish_reason)}
    lp = result.logprobs if req.logprobs is not None else None
    if req.chat:
        thought, text = reasoning.split(result.text) if reasoning is not None else (None, result.text)
        choice["message"] = {"role": "assistant", "content": text}
        if req.parses_calls and req.tools is not None:
            content, calls = req.tools.parse(text, truncated=result.finish_reason == "length")
            if calls:
                choice["message"] = {"role": "assistant", "content": content,
                                     "tool_calls": [c.as_openai() for c in calls]}
                if result.finish_reason in ("stop", "eos"):
                    choice["finish_reason"] = "tool_calls"
        if thought is not None:
            choice["message"]["reasoning_content"] = thought
        choice["logprobs"] = chat_logprobs(lp, piece) if lp is not None else None
    else:
        choice["text"] = result.text
        choice["logprobs"] = completion_logprobs(lp, piece) if lp is not None else None
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage(result, prompt_tokens),
            "edgespec": speculation_stats(result, timings)}


def choices_body(bodies: Sequence[dict]) -> dict:
    """n completion bodies (completion_body, choice 0 each) as one response: choice i at index i,
    the prompt's tokens counted once, the choices' completion tokens summed; `edgespec` holds
    the first choice's speculation figures and `choices` all of them."""
    out = dict(bodies[0])
    out["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    u = dict(bodies[0]["usage"])
    u["completion_tokens"] = sum(b["usage"]["completion_tokens"] for b in bodies)
    u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
    out["usage"] = u
    out["edgespec"] = {**bodies[0]["edgespec"], "choices": [b["edgespec"] for b in bodies]}
    return out


def choices_usage(results: Sequence[GenerationResult], prompt_tokens: int) -> dict:
    """The usage of n choices of one prompt: the prompt counted once, the completions summed."""
    u = usage(results[0], prompt_tokens)
    u["completion_tokens"] = sum(len(r.token_ids) for r in results)
    u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
    return u


def chunk_body(req: CompletionRequest, *, rid: str, created: int, model: str, text: str | None,
               finish: str | None = None, logprobs: Sequence[TokenLogprob] = (), piece: Piece | None = None,
               role: bool = False, offset: int = 0, index: int = 0) -> dict:
    """One stream event's body (a delta, the role opener, or the finishing chunk) of choice `index`."""
    choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason(finish)}
    lp = None
    if req.logprobs is not None and logprobs and piece is not None:
        lp = chat_logprobs(logprobs, piece) if req.chat else completion_logprobs(logprobs, piece, offset)
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice["logprobs"] = lp
    return {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}


def tool_chunks(req: CompletionRequest, events: Sequence[tuple[str, Any]], *, rid: str, created: int, model: str,
                index: int = 0) -> list[dict]:
    """Stream bodies for AnswerStream events of choice `index`: content deltas, and each call in
    OpenAI's shape at its own index: a header as soon as its name is read (id, type, name, empty
    arguments), then fragments of its arguments' JSON text as they are written."""
    out = []
    for kind, value in events:
        if kind == "content":
            if value:
                out.append(chunk_body(req, rid=rid, created=created, model=model, text=value, index=index))
            continue
        d: tools_mod.CallDelta = value
        delta = {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}} \
            if d.id is not None else {"index": d.index, "function": {"arguments": d.arguments}}
        body = chunk_body(req, rid=rid, created=created, model=model, text=None, index=index)
        body["choices"][0]["delta"] = {"tool_calls": [delta]}
        out.append(body)
    return out


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


class CompletionStream:
    """OpenAI's stream (chat.completion.chunk or text_completion events, `data: [DONE]` at the
    end) for a streamed answer's events (edgespec.server.answer): choice i's chunks at index i,
    a role chunk per choice first (chat), its tool calls as delta.tool_calls, its finishing
    chunk with the `edgespec` object, the usage chunk with include_usage; a keep-alive comment
    while the request waits."""

    def __init__(self, req: CompletionRequest, *, rid: str, created: int, model: str, n: int,
                 piece: Piece | None = None):
        self.req, self.n, self.piece = req, n, piece
        self.kw: dict[str, Any] = {"rid": rid, "created": created, "model": model}

    def start(self) -> bytes:
        if not self.req.chat:
            return b""
        return b"".join(sse(chunk_body(self.req, text=None, role=True, index=i, **self.kw)) for i in range(self.n))

    def event(self, ev: answer.Event) -> bytes:
        req, kw = self.req, self.kw
        if isinstance(ev, answer.Text):
            return sse(chunk_body(req, text=ev.text, logprobs=ev.logprobs, piece=self.piece, offset=ev.offset,
                                  index=ev.index, **kw))
        if isinstance(ev, answer.Call):
            return sse(tool_chunks(req, [("call", ev.delta)], index=ev.index, **kw)[0])
        if isinstance(ev, answer.Reasoning):  # llama-server's and vLLM's delta.reasoning_content
            body = chunk_body(req, text=None, index=ev.index, **kw)
            body["choices"][0]["delta"] = {"reasoning_content": ev.text}
            return sse(body)
        if isinstance(ev, answer.End):
            last = chunk_body(req, text=None, finish=ev.finish, index=ev.index, **kw)
            last["edgespec"] = speculation_stats(ev.result, ev.timings)
            return sse(last)
        if isinstance(ev, answer.Usage):
            if not req.include_usage:
                return b""
            return sse({"id": kw["rid"], "object": "chat.completion.chunk" if req.chat else "text_completion",
                        "created": kw["created"], "model": kw["model"], "choices": [],
                        "usage": choices_usage(ev.results, ev.prompt_tokens)})
        return b": ping\n\n"  # Waiting: an SSE comment keeps proxies from timing the stream out

    def error(self, status: int, message: str, openai_body: Mapping) -> bytes:
        return sse(openai_body)

    def end(self) -> bytes:
        return b"data: [DONE]\n\n"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
