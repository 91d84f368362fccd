"""One session's step through the tick's phases: `StepRecord` (what each phase hands the next:
`Session.record`, from begin_step to observe), the tick's `Batch` as its grafts price it, the
statistics a verified step adds, and the `StepOutcome` the step reports to its controller."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgespec.shape import Shape, StepOutcome
from edgespec.tick.layout import Layout
from edgespec.tree import DraftTree
from edgespec.types import SpecStats
from edgespec.verify import VerifyResult


@dataclass
class Batch:
    """The tick's verification as the prompt lookups see it while they graft, one session after
    the other: its tokens so far and the seconds per expected token of the tick (what a lookup
    token must beat to be worth its place in the forward)."""

    tokens: int = 0
    unit: float = 0.0


@dataclass(slots=True, eq=False)
class StepRecord:
    shape: Shape  # what the schedule chose for this step
    tree: DraftTree  # the root, then the drafter's nodes, then the grafts'
    t0: float  # perf_counter() as the step began
    lookup: list[int] = field(default_factory=list)  # the prompt lookup's tokens (n-gram drafter)
    kind: int = 0  # the lookup's kind (NgramDrafter.reach)
    draft_batches: tuple[int, ...] = ()  # [draft forwards] batch size of each
    levels: int = 0  # levels the drafter drafted
    spine_probs: tuple[float, ...] = ()  # the draft's first-choice probability per level
    draft_ran: bool = False
    ngram_only: bool = False  # a plain step whose tree is grafts alone (lookup, suffix)
    forced: bool = False  # grammar-forced tokens grafted (structured output)
    bare: bool = False  # the goodput guard's plain step: no prompt-lookup or suffix grafts either
    guessed: int = 0  # nodes the drafter, the prompt lookup and the suffix cache put in the tree
    sources: list[tuple[int, str]] = field(default_factory=list)  # (first node, source) in node order
    batch: Batch | None = None  # the tick's verification (several sessions), None alone
    layout: Layout | None = None  # where the tree sits in the slot's range (tick/layout.py)
    features: np.ndarray | None = None  # the target's features of the step's entries (a head's)
    result: VerifyResult | None = None
    emitted: int = 0  # tokens the step emitted (accepted + the bonus/recovered one)


def count_sources(stats: SpecStats, sources: list[tuple[int, str]], n: int, accepted: list[int]) -> None:
    """Proposed and accepted draft nodes per source: node i came from the last source whose
    first node is <= i (sources graft one after the other)."""
    if n <= 1:
        return
    bounds = [min(b, n) for b, _ in sources] + [n]
    for j, (_, name) in enumerate(sources):
        lo, hi = bounds[j], max(bounds[j], bounds[j + 1])
        if hi > lo:
            stats.proposed_by_source[name] = stats.proposed_by_source.get(name, 0) + hi - lo
            got = sum(1 for i in accepted if lo <= i < hi)
            if got:
                stats.accepted_by_source[name] = stats.accepted_by_source.get(name, 0) + got


def count_verified(stats: SpecStats, st: StepRecord, res: VerifyResult) -> None:
    """A verified step's counts: one target forward, its drafts, what was accepted (by source,
    by depth), the step's kind."""
    tree = st.tree
    stats.target_forwards += 1
    stats.drafted_tokens += tree.n_draft
    stats.accepted_tokens += len(res.accepted)
    count_sources(stats, st.sources, len(tree), res.accepted)
    for d in range(len(res.accepted)):
        if len(stats.accepted_per_depth) <= d:
            stats.accepted_per_depth.append(0)
        stats.accepted_per_depth[d] += 1
    kind = "ngram" if st.ngram_only else "forced" if st.forced and st.shape.mode == "plain" else st.shape.kind
    stats.steps_per_mode[kind] = stats.steps_per_mode.get(kind, 0) + 1


def outcome(st: StepRecord, *, draft_share: float, verify_share: float, overhead_seconds: float) -> StepOutcome:
    """What the controller learns from the step (its shape's acceptance and cost)."""
    res, lay = st.result, st.layout
    assert res is not None and lay is not None  # a verified step's
    return StepOutcome(
        shape=st.shape, accepted_ranks=tuple(res.ranks), offered=tuple(res.offered),
        emitted=st.emitted, draft_seconds=draft_share, draft_batches=st.draft_batches,
        verify_seconds=verify_share, verify_tokens=len(st.tree), depth_drafted=st.levels,
        overhead_seconds=overhead_seconds, spine_probs=st.spine_probs, context=lay.root_pos)
