"""protobuf <-> domain types, and request validation (every field, named, with its range).
The servicers stay thin: they call these and the engine loop."""

from __future__ import annotations

import json
from collections.abc import Sequence

from edgespec.errors import BadRequest
from edgespec.proto.edgespec.v1 import admin_pb2
from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.reasoning import EFFORT_BUDGETS, EFFORTS, template_variables
from edgespec.sampling import SamplingParams
from edgespec.server.config import LimitsConfig
from edgespec.server.policy import Policy, sampling_for, speculation_for
from edgespec.settings import SAMPLING, SPECULATION
from edgespec.tools import ToolCall, ToolSpec, parse_history_calls, parse_tools
from edgespec.types import MAX_TOP_LOGPROBS, ConstraintSpec, GenerationResult, SpeculationParams, TokenLogprob

ROLES = ("system", "user", "assistant", "tool")
_MODES = {pb.AUTO: "auto", pb.OFF: "plain", pb.CHAIN: "chain", pb.TREE: "tree"}
FINISH = {
    "stop": pb.STOP, "length": pb.LENGTH, "eos": pb.EOS,
    "cancelled": pb.CANCELLED, "deadline": pb.DEADLINE, "error": pb.ERROR, "tool_calls": pb.TOOL_CALLS,
}
_POLICY_IN = {admin_pb2.SPECULATION_POLICY_AUTO: "auto", admin_pb2.SPECULATION_POLICY_OFF: "off"}
_POLICY_OUT = {v: k for k, v in _POLICY_IN.items()}


DEFAULT_LIMITS = LimitsConfig()


def text_within(text: str, field: str, limits: LimitsConfig) -> str:
    """A prompt / Tokenize text no longer than limits.max_prompt_bytes (UTF-8)."""
    n = len(text.encode("utf-8"))
    if n > limits.max_prompt_bytes:
        raise BadRequest(field, f"at most {limits.max_prompt_bytes} bytes (limits.max_prompt_bytes), got {n}")
    return text


def tools_from(req: pb.GenerateRequest) -> ToolSpec | None:
    """GenerateRequest.tools as OpenAI's fields, checked by edgespec.tools (fields named tools.*)."""
    if not req.HasField("tools") or not req.tools.tools:
        if req.HasField("tools") and req.tools.choice not in ("", "none", "auto"):
            raise BadRequest("tools.choice", "needs tools")
        return None
    if not req.messages:
        raise BadRequest("tools", "tool calling needs messages, not a prompt")
    specs = []
    for i, t in enumerate(req.tools.tools):
        params = None
        if t.parameters_json:
            try:
                params = json.loads(t.parameters_json)
            except ValueError:
                raise BadRequest(f"tools.tools[{i}].parameters_json", "must be JSON text") from None
        specs.append({"type": "function", "function": {"name": t.name, "description": t.description,
                                                       **({"parameters": params} if params is not None else {})}})
    c = req.tools.choice
    choice: object = None if c == "" else c if c in ("auto", "none", "required") else \
        {"type": "function", "function": {"name": c}}
    parallel = req.tools.parallel_tool_calls if req.tools.HasField("parallel_tool_calls") else None
    try:
        return parse_tools(specs, choice, parallel)
    except BadRequest as exc:
        field = exc.field.replace("tool_choice.function.name", "choice").replace("tool_choice", "choice") \
            .replace(".function.", ".").replace("parallel_tool_calls", "parallel_tool_calls")
        raise BadRequest(f"tools.{field}", str(exc).split(": ", 1)[-1]) from None


def reasoning_from(req: pb.GenerateRequest) -> tuple[dict, int | None]:
    """GenerateRequest.reasoning as (the chat template's variables, the <think> block's budget)."""
    if not req.HasField("reasoning"):
        return {}, None
    r = req.reasoning
    if r.effort and r.effort not in EFFORTS:
        raise BadRequest("reasoning.effort", f"must be one of {', '.join(EFFORTS)}, got {r.effort!r}")
    if r.HasField("budget_tokens") and r.budget_tokens < 1:
        raise BadRequest("reasoning.budget_tokens", f"must be >= 1, got {r.budget_tokens}")
    if not req.messages and (r.effort or r.HasField("enable_thinking") or r.HasField("budget_tokens")):
        raise BadRequest("reasoning", "is for messages, not a prompt")
    variables = template_variables(r.effort or None, r.enable_thinking if r.HasField("enable_thinking") else None)
    budget = r.budget_tokens if r.HasField("budget_tokens") else EFFORT_BUDGETS.get(r.effort)
    return variables, budget


def message_extras(msgs: Sequence[pb.ChatMessage]) -> tuple[dict, ...]:
    """Each ChatMessage's tool_calls / tool_call_id, as edgespec.tools reads them (empty when none has any)."""
    out: list[dict] = []
    for i, m in enumerate(msgs):
        e: dict = {}
        if m.tool_calls:
            if m.role != "assistant":
                raise BadRequest(f"messages[{i}].tool_calls", "only assistant messages carry tool calls")
            e["tool_calls"] = parse_history_calls(
                [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments or "{}"}}
                 for c in m.tool_calls], f"messages[{i}].tool_calls")
        if m.tool_call_id:
            e["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            if m.role != "assistant":
                raise BadRequest(f"messages[{i}].reasoning_content", "only assistant messages carry reasoning")
            e["reasoning_content"] = m.reasoning_content
        out.append(e)
    return tuple(out) if any(out) else ()


def messages_from(msgs: Sequence[pb.ChatMessage], field: str = "messages",
                  limits: LimitsConfig = DEFAULT_LIMITS) -> tuple[tuple[str, str], ...]:
    """Checked before any of it is looked at further: the count, then each role, then the contents'
    total size (the chat template and the tokenizer only ever see what passed)."""
    n = len(msgs)
    if n > limits.max_messages:
        raise BadRequest(field, f"at most {limits.max_messages} messages (limits.max_messages), got {n}")
    out = []
    size = 0
    for i, m in enumerate(msgs):
        if m.role not in ROLES:
            raise BadRequest(f"{field}[{i}].role", f"must be one of {', '.join(ROLES)}, got {m.role!r}")
        size += len(m.content.encode("utf-8")) + sum(len(c.arguments.encode("utf-8")) for c in m.tool_calls) + \
            len(m.reasoning_content.encode("utf-8"))
        if size > limits.max_prompt_bytes:
            raise BadRequest(f"{field}[{i}].content", f"the messages' contents together at most "
                             f"{limits.max_prompt_bytes} bytes (limits.max_prompt_bytes)")
        out.append((m.role, m.content))
    return tuple(out)


def sampling_from(s: pb.SamplingOptions, policy: Policy, limits: LimitsConfig = DEFAULT_LIMITS) -> SamplingParams:
    """Unset fields take defaults; every set field is range-checked (BadRequest names it)."""
    values = {name: getattr(s, name) if s.HasField(name) else None for name in SAMPLING}
    values["logit_bias"] = dict(s.logit_bias) or None
    return sampling_for(policy, limits, {**values, "stop": tuple(s.stop)}, prefix="sampling.")


def speculation_from(s: pb.SpeculationOptions, policy: Policy) -> SpeculationParams:
    if s.mode not in _MODES:
        raise BadRequest("speculation.mode", f"must be one of AUTO, OFF, CHAIN, TREE, got {s.mode}")
    shape = {name: getattr(s, name) if s.HasField(name) else None for name in SPECULATION}
    return speculation_for(policy, _MODES[s.mode], shape, s.ngram if s.HasField("ngram") else None,
                           prefix="speculation.")


def constraint_from(s: pb.SamplingOptions) -> ConstraintSpec | None:
    """sampling.constraint -> ConstraintSpec (None when unset)."""
    if not s.HasField("constraint"):
        return None
    c = s.constraint
    try:
        return ConstraintSpec(c.kind, c.value)  # type: ignore[arg-type]
    except BadRequest as exc:
        raise BadRequest(f"sampling.{exc.field}", str(exc).split(": ", 1)[-1]) from None


def logprobs_from(req: pb.GenerateRequest) -> int | None:
    """None: no logprobs; k: each token's logprob and its k best alternatives."""
    lp = req.logprobs
    if lp.top_logprobs and not lp.logprobs:
        raise BadRequest("logprobs.top_logprobs", "needs logprobs.logprobs = true")
    if not 0 <= lp.top_logprobs <= MAX_TOP_LOGPROBS:
        raise BadRequest("logprobs.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {lp.top_logprobs}")
    return lp.top_logprobs if lp.logprobs else None


def logprobs_to_pb(items: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=it.token, logprob=it.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in it.top]) for it in items]


def prompt_from(req: pb.GenerateRequest, limits: LimitsConfig = DEFAULT_LIMITS) -> tuple[str, tuple[tuple[str, str], ...]]:
    if req.prompt and req.messages:
        raise BadRequest("prompt", "set either prompt or messages, not both")
    if not req.prompt and not req.messages:
        raise BadRequest("prompt", "one of prompt or messages is required")
    return text_within(req.prompt, "prompt", limits), messages_from(req.messages, limits=limits)


def response(result: GenerationResult | None, *, text: str, token_ids: list[int] | tuple[int, ...],
             timings: dict[str, float] | None, request_id: str, prompt_tokens: int = 0,
             logprobs: tuple[TokenLogprob, ...] | list[TokenLogprob] = (),
             tool_calls: Sequence[ToolCall] = (), reasoning: str = "") -> pb.GenerateResponse:
    """A unary response / a final stream chunk (when `result` is set) / a plain chunk (result None).
    `logprobs`: one per token id of this message, when the request asked for them; `reasoning`:
    the reasoning split from `text` (a thinking model's)."""
    out = pb.GenerateResponse(text=text, token_ids=list(token_ids), request_id=request_id,
                              logprobs=logprobs_to_pb(logprobs), reasoning=reasoning)
    if result is None:
        return out
    st = result.stats
    out.finish_reason = FINISH.get(result.finish_reason, pb.ERROR)
    if tool_calls:
        out.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in tool_calls)
        if result.finish_reason in ("stop", "eos"):
            out.finish_reason = pb.TOOL_CALLS
    out.usage.prompt_tokens = result.prompt_tokens or prompt_tokens
    out.usage.completion_tokens = len(result.token_ids)
    out.usage.cached_prompt_tokens = st.cached_prompt_tokens
    out.usage.draft_cached_tokens = st.draft_cached_tokens
    sp = out.speculation
    sp.target_forwards = st.target_forwards
    sp.draft_forwards = st.draft_forwards
    sp.drafted_tokens = st.drafted_tokens
    sp.accepted_tokens = st.accepted_tokens
    sp.tau = st.tau
    sp.breaker_transitions = st.breaker_transitions
    sp.accepted_per_depth.extend(st.accepted_per_depth)
    for mode, n in st.steps_per_mode.items():
        sp.steps_per_mode[mode] = n
    if timings:
        out.timings.queue_seconds = timings["queue_seconds"]
        out.timings.time_to_first_token_seconds = timings["time_to_first_token_seconds"]
        out.timings.total_seconds = timings["total_seconds"]
        out.timings.verify_seconds = st.target_seconds
        out.timings.draft_seconds = st.draft_seconds
    return out


def policy_to_pb(p: Policy) -> admin_pb2.Policy:
    return admin_pb2.Policy(speculation=_POLICY_OUT[p.speculation], max_draft_tokens=p.max_draft_tokens,
                            max_tree_nodes=p.max_tree_nodes, max_tree_depth=p.max_tree_depth, max_tokens=p.max_tokens)


def policy_changes(req: admin_pb2.SetPolicyRequest) -> dict[str, object]:
    """The fields a SetPolicy request sets (its admin overrides), by Policy field name."""
    changes: dict[str, object] = {}
    if req.speculation != admin_pb2.SPECULATION_POLICY_UNSPECIFIED:
        if req.speculation not in _POLICY_IN:
            raise BadRequest("speculation", "must be SPECULATION_POLICY_AUTO or SPECULATION_POLICY_OFF")
        changes["speculation"] = _POLICY_IN[req.speculation]
    for name in ("max_draft_tokens", "max_tree_nodes", "max_tree_depth", "max_tokens"):
        if req.HasField(name):
            changes[name] = getattr(req, name)
    return changes


def with_overrides(base: Policy, overrides: dict[str, object]) -> Policy:
    """The config file's policy with the admin overrides on top (BadRequest naming a bad field)."""
    new = base.replace(**overrides)
    return new.replace(default_max_tokens=min(new.default_max_tokens, new.max_tokens))
