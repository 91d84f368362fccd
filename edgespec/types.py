"""Domain types shared by the engine, the CLI, the daemon and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from edgespec.errors import BadRequest
from edgespec.sampling import SamplingParams
from edgespec.settings import SPECULATION, check_fields, setting

Mode = Literal["plain", "chain", "tree", "auto"]
MODES: tuple[str, ...] = ("plain", "chain", "tree", "auto")
FinishReason = Literal["stop", "length", "eos", "cancelled", "deadline", "error"]

@dataclass(frozen=True)
class SpeculationParams:
    """How to speculate. The defaults and ranges are the [speculation] keys of edgespec.settings
    (chain drafts 4, a tree verifies at most 16 nodes, at most 6 deep)."""

    mode: Mode = "auto"
    draft_tokens: int = setting("speculation", "draft_tokens").default  # chain length
    tree_nodes: int = setting("speculation", "tree_nodes").default  # tree node budget (excluding the root)
    tree_depth: int = setting("speculation", "tree_depth").default
    ngram: bool = setting("speculation", "ngram").default  # also use model-free prompt-lookup drafts
    suffix: bool = True  # also draft from the engine's cross-request suffix cache (when it has one)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise BadRequest("mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        check_fields({k: getattr(self, k) for k in SPECULATION}, SPECULATION)

    @property
    def context_headroom(self) -> int:
        """Context tokens a request needs beyond prompt + max_tokens: a step's root and deepest
        tree path, plus 2."""
        return 2 + self.tree_depth + 1


ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "lark"]
CONSTRAINT_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "grammar", "lark")


@dataclass(frozen=True)
class ReasoningBudget:
    """A thinking model's <think> block held to at most `tokens` tokens (its opening tag
    included); when they are spent, `close` (the text the template closes a block with) is forced
    and the answer follows. `opened`: the prompt opened the block (edgespec/budget.py)."""

    tokens: int
    close: str = "\n</think>\n\n"
    opened: bool = False


@dataclass(frozen=True)
class ConstraintSpec:
    """Structured output: the text the request may produce. `value` is a JSON schema (as JSON
    text), a regular expression, a GBNF grammar or a Lark grammar; empty for json_object (any
    JSON object). Decoding samples from the target's distribution masked to what the
    constraint allows (edgespec/constraint.py)."""

    kind: ConstraintKind
    value: str = ""
    budget: ReasoningBudget | None = None  # a reasoning budget the mask holds besides `value`

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise BadRequest("constraint.kind", f"must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.value:
            raise BadRequest("constraint.value", f"is empty (a {self.kind} constraint needs its text)")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculation: SpeculationParams = field(default_factory=SpeculationParams)
    request_id: str = ""
    # None: no logprobs; k >= 0: each emitted token's logprob and its k best alternatives, from
    # the target's transformed distribution (the verification rows: the same in every mode)
    logprobs: int | None = None
    constraint: ConstraintSpec | None = None
    # who asks ("token:<name>", "cert:<subject>", "" for anonymous): the suffix cache's partition
    caller: str = ""
    # `constraint` compiled already (a constraint.Matcher from Engine.compile_constraint, in the
    # caller's thread), or None: the engine compiles it as the session opens
    matcher: Any = None


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target's (transformed, masked) distribution,
    and the `top` best alternatives (token, logprob), best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class SpecStats:
    target_forwards: int = 0
    draft_forwards: int = 0
    drafted_tokens: int = 0  # tree/chain nodes sent to the target for verification
    accepted_tokens: int = 0  # draft tokens accepted (excludes the bonus/recovered token)
    emitted_tokens: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)  # [depth-1] -> count
    steps_per_mode: dict[str, int] = field(default_factory=dict)
    breaker_transitions: int = 0
    seconds: float = 0.0
    python_overhead_seconds: float = 0.0  # time outside llama_decode in steps
    target_seconds: float = 0.0  # time inside the target's llama_decode in steps (verification)
    draft_seconds: float = 0.0  # time inside the draft's llama_decode in steps (its prefill included)
    cached_prompt_tokens: int = 0  # prompt tokens whose KV the slot kept from an earlier request
    draft_cached_tokens: int = 0  # context tokens whose draft KV the slot kept (the draft absorbs the rest)
    # draft tokens verified / accepted per source: draft (a draft model), head (an EAGLE-3 head),
    # prompt_lookup (n-grams of the request's own context), suffix (the cross-request cache), forced
    # (tokens a grammar forces); a node two sources proposed counts for the first
    proposed_by_source: dict[str, int] = field(default_factory=dict)
    accepted_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Mean emitted tokens per target forward."""
        return self.emitted_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.emitted_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "emitted_tokens": self.emitted_tokens,
            "tau": round(self.tau, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "seconds": round(self.seconds, 4),
            "python_overhead_seconds": round(self.python_overhead_seconds, 4),
            "target_seconds": round(self.target_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "accepted_per_depth": list(self.accepted_per_depth),
            "steps_per_mode": dict(self.steps_per_mode),
            "breaker_transitions": self.breaker_transitions,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "draft_cached_tokens": self.draft_cached_tokens,
            "proposed_by_source": dict(self.proposed_by_source),
            "accepted_by_source": dict(self.accepted_by_source),
        }


@dataclass(frozen=True)
class Chunk:
    """What one engine step emitted (possibly several tokens when a tree accepts several)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when the request asked for them


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    stats: SpecStats
    logprobs: list[TokenLogprob] = field(default_factory=list)
