"""What the engine reports back after a step (StepOutcome). `Shape`, what the controller
decides, lives below every package in edgespec/shape.py (re-exported here)."""

from __future__ import annotations

from dataclasses import dataclass

from edgespec.shape import PLAIN, Shape, ShapeMode, calib_bucket, chain, eagle, runner_ups

__all__ = ["PLAIN", "Shape", "ShapeMode", "StepOutcome", "calib_bucket", "chain", "eagle", "plain_outcome",
           "runner_ups"]


@dataclass(frozen=True)
class StepOutcome:
    """What happened in one engine step. Ranks are positions among the children offered at a node,
    ordered by draft probability (0 = the draft's best)."""

    shape: Shape
    accepted_ranks: tuple[int, ...]  # [accepted depth] sibling rank of the accepted child at each depth
    # [len(accepted_ranks) + 1] children offered at each node of the accepted path; the last entry is
    # the node where verification stopped (0 = a leaf: the bonus token was taken)
    offered: tuple[int, ...]
    emitted: int  # tokens emitted (normally len(accepted_ranks) + 1)
    draft_seconds: float
    draft_batches: tuple[int, ...]  # [draft forwards] batch size of each draft forward this step
    verify_seconds: float
    verify_tokens: int  # target batch size (root + nodes)
    depth_drafted: int  # levels actually drafted (< shape.depth when stop_prob cut it short)
    overhead_seconds: float = 0.0  # optional: step time outside draft and target forwards
    # the draft model's probability of its first-choice child at each level along the path of
    # first choices from the root (what the confidence calibration learns from)
    spine_probs: tuple[float, ...] = ()
    context: int | None = None  # tokens cached before the verification forward (None: not known)

    @property
    def speculative(self) -> bool:
        return self.shape.mode != "plain"


def plain_outcome(verify_seconds: float, emitted: int = 1, overhead_seconds: float = 0.0) -> StepOutcome:
    return StepOutcome(PLAIN, (), (0,), emitted, 0.0, (), verify_seconds, 1, 0, overhead_seconds)
