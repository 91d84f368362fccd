"""What the tick may touch: the narrow faces of a session and of the engine that its phases see,
and the record a tick leaves.

The tick's floor plan, from the ground up: tick/layout.py and tick/step.py (a step's KV layout,
its `StepRecord`, the tick's `Batch`), this module (the Protocols and `TickRecord`), then the
phases, each in a module named after it (schedule, draft, forward, observe; graft and verdict,
which a session's own step calls), and tick/__init__.py, which runs them in order. A phase
module reads and calls only what these Protocols name and imports neither the session nor the
engine: `Session` (edgespec/session.py) implements `TickSession`, `GraftSession` and
`VerdictSession`; `Engine` (edgespec/engine.py) implements `TickEngine`. A test's fake may
implement any of them without the rest of the class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from edgespec.drafters.base import DraftSteps

if TYPE_CHECKING:
    from edgespec import backend
    from edgespec.budget import BudgetMatcher
    from edgespec.config import EngineConfig
    from edgespec.constraint import Matcher
    from edgespec.controller import Controller, CostModel, Decision
    from edgespec.controller.goodput import GoodputGuard
    from edgespec.controller.threads import ThreadGovernor
    from edgespec.drafters import NgramDrafter
    from edgespec.drafters.base import Drafter, DraftReport
    from edgespec.drafters.ngram import ReachPriors
    from edgespec.drafters.suffix import SuffixDrafter
    from edgespec.kv import SeqRange
    from edgespec.penalties import Adjuster
    from edgespec.sampling import SamplingParams
    from edgespec.shape import Shape
    from edgespec.slots import Slot
    from edgespec.tick.step import Batch, StepRecord
    from edgespec.types import Chunk, GenerationRequest, SpecStats

__all__ = ["DraftSteps", "GraftSession", "TargetBatch", "TickEngine", "TickRecord", "TickSession",
           "VerdictSession"]
# one step's part of a forward: (tokens, positions, global seq ids per token)
TargetBatch = tuple[list[int], list[int], list[list[int]]]


@dataclass
class TickRecord:
    """What one tick did (tick/observe.py leaves it in `TickEngine.last_tick`)."""

    sessions: int
    decoding: int
    verify_tokens: int
    draft_forwards: int
    prefill_tokens: int
    seconds: dict[str, float]  # phase -> seconds


class TickSession(Protocol):
    """One request as the tick sees it: what it reads to plan the step (`decide`, which changes
    nothing), and the hooks it calls in order (begin_step, draft_steps / absorb_steps, drafted,
    target_batch, finish_step, observe; prefill_piece, prefill_done and the fused first step for a
    prompt being read)."""

    controller: Controller | None
    drafter: Drafter | None
    drafter_kind: str | None
    draft_range: SeqRange | None
    slot: Slot
    tokens: list[int]
    n_prompt: int
    stats: SpecStats
    record: StepRecord | None
    guard_seen: bool
    suffix: SuffixDrafter | None

    @property
    def matcher(self) -> Matcher | BudgetMatcher | None: ...
    @property
    def prefilling(self) -> bool: ...
    @property
    def done(self) -> bool: ...
    @property
    def remaining(self) -> int: ...
    @property
    def context(self) -> int: ...
    @property
    def fuses_first(self) -> bool: ...

    def decide(self) -> Decision: ...
    def begin_step(self, shape: Shape, batch: Batch | None = None, bare: bool = False) -> None: ...
    def draft_steps(self) -> DraftSteps | None: ...
    def absorb_steps(self, budget: int) -> DraftSteps: ...
    def drafted(self, report: DraftReport | None) -> None: ...
    def target_batch(self) -> TargetBatch: ...
    def verified_features(self, features: np.ndarray) -> None: ...
    def finish_step(self, rows: np.ndarray) -> Chunk: ...
    def prefill_piece(self, limit: int) -> tuple[list[int], int]: ...
    def prefill_done(self, n: int, features: np.ndarray | None = None) -> None: ...
    def first_step_batch(self, bare: bool = False) -> TargetBatch: ...
    def first_step(self, rows: np.ndarray, features: np.ndarray | None) -> Chunk: ...
    def observe(self, *, target_seconds: float, draft_seconds: float, verify_share: float, draft_share: float,
                step_seconds: float) -> None: ...


class TickEngine(Protocol):
    """The engine as the tick sees it: the shared cost model and goodput guard, the thread
    governor, the prompt lookups' priors, the target context, the totals it adds to."""

    cfg: EngineConfig
    cost: CostModel
    goodput: GoodputGuard
    threads: ThreadGovernor
    lookup_priors: ReachPriors
    tick_totals: dict[str, float]
    last_tick: TickRecord | None

    @property
    def threads_now(self) -> int: ...
    @property
    def target_ctx(self) -> backend.Context: ...
    @property
    def features(self) -> bool: ...

    def cost_kind(self, kind: str | None) -> str: ...


class GraftSession(Protocol):
    """What the grafts (tick/graft.py) read of the session whose step they graft onto: its
    context and sampling, its drafters and controller, its grammar state, its room, and the
    shared cost model that prices a graft's place in the verification."""

    @property
    def tokens(self) -> list[int]: ...
    @property
    def n_past(self) -> int: ...
    @property
    def remaining(self) -> int: ...
    @property
    def sampling(self) -> SamplingParams: ...
    @property
    def rng(self) -> np.random.Generator: ...
    @property
    def slot(self) -> Slot: ...
    @property
    def controller(self) -> Controller | None: ...
    @property
    def drafter(self) -> Drafter | None: ...
    @property
    def ngram(self) -> NgramDrafter | None: ...
    @property
    def suffix(self) -> SuffixDrafter | None: ...
    @property
    def matcher(self) -> Matcher | BudgetMatcher | None: ...
    @property
    def cost(self) -> CostModel: ...

    def room(self) -> int: ...


class VerdictSession(Protocol):
    """What verification (tick/verdict.py) reads of the session whose rows it verifies: the
    request (its sampling, its logprobs), the context the penalties count, the adjuster and the
    grammar state that shape its distribution, and its random stream."""

    @property
    def req(self) -> GenerationRequest: ...
    @property
    def sampling(self) -> SamplingParams: ...
    @property
    def tokens(self) -> list[int]: ...
    @property
    def n_prompt(self) -> int: ...
    @property
    def rng(self) -> np.random.Generator: ...
    @property
    def adjuster(self) -> Adjuster | None: ...
    @property
    def matcher(self) -> Matcher | BudgetMatcher | None: ...
