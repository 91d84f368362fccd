"""What the tick may touch: the narrow faces of a session and of the engine that its phases see.

A phase module reads and calls only what these Protocols name. `Session` (edgespec/session.py)
implements `TickSession`, `Engine` (edgespec/engine.py) implements `TickEngine`; a test's fake
may implement either without the rest of the class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from edgespec.drafters.base import DraftSteps

if TYPE_CHECKING:
    from edgespec import backend
    from edgespec.config import EngineConfig
    from edgespec.controller import Controller, CostModel
    from edgespec.controller.goodput import GoodputGuard
    from edgespec.controller.threads import ThreadGovernor
    from edgespec.drafters.base import Drafter, DraftReport
    from edgespec.drafters.ngram import ReachPriors
    from edgespec.drafters.suffix import SuffixDrafter
    from edgespec.kv import SeqRange
    from edgespec.shape import Shape
    from edgespec.slots import Slot
    from edgespec.tick.observe import TickRecord
    from edgespec.tick.schedule import Batch
    from edgespec.tick.step import StepRecord
    from edgespec.types import Chunk, SpecStats

__all__ = ["DraftSteps", "TargetBatch", "TickEngine", "TickSession"]
# one step's part of a forward: (tokens, positions, global seq ids per token)
TargetBatch = tuple[list[int], list[int], list[list[int]]]


class TickSession(Protocol):
    """One request as the tick sees it: what it reads to plan the step, and the hooks it calls in
    order (begin_step, draft_steps / absorb_steps, drafted, target_batch, finish_step, observe;
    prefill_piece, prefill_done and the fused first step for a prompt being read)."""

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
    def prefilling(self) -> bool: ...
    @property
    def done(self) -> bool: ...
    @property
    def remaining(self) -> int: ...
    @property
    def context(self) -> int: ...
    @property
    def fuses_first(self) -> bool: ...

    def choose_shape(self) -> Shape: ...
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
