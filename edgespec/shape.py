"""What a step speculates: `Shape` (plain, a chain, chain + runner-ups, an EAGLE-2 tree) and
its constructors, and what came of it: `StepOutcome`. Below every package that needs them: the
controller chooses shapes and learns from outcomes, the schedule prices shapes, the drafters grow
trees to them, the tick reports the outcomes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ShapeMode = Literal["plain", "chain", "tree"]


def calib_bucket(p: float, buckets: int) -> int:
    """The bucket of a draft probability p among `buckets` equal ones over [0, 1]."""
    return min(buckets - 1, max(0, int(p * buckets)))


@dataclass(frozen=True)
class Shape:
    """One step's speculation shape. The target batch is `nodes + 1` (the root = last emitted token).

    - plain: no drafting, the target decodes one token.
    - chain: `depth` drafted tokens, one draft forward each; nodes == depth.
    - tree with runner_ups > 0: a chain of `depth` whose every position also gets the draft's next
      `runner_ups` best tokens as leaves (no extra draft forward); width = 1 + runner_ups,
      nodes = depth * (1 + runner_ups).
    - tree with runner_ups == 0: EAGLE-2 style. Level 1 = the root's top-`width` children; each
      further level expands the `expand` frontier nodes of highest cumulative draft probability
      into their top-`width` children; after `depth` levels the `nodes` nodes of highest cumulative
      draft probability are verified.
    """

    mode: ShapeMode
    depth: int = 0  # draft levels = draft forwards (chain: number of drafted tokens)
    width: int = 1  # max children per expanded node (top-k branching)
    nodes: int = 0  # node budget excluding the root (chain: == depth)
    runner_ups: int = 0  # chain + runner-ups (see above)
    expand: int = 1  # EAGLE-2: frontier nodes expanded per level
    stop_prob: float = 0.0  # drafter stops adding levels when the best frontier path's acceptance estimate < this
    # per level, where the economics set it lower than stop_prob: stop_levels[j - 1] is the
    # threshold for drafting level j + 1 (ShapePolicy.stop_levels); levels beyond it use stop_prob
    stop_levels: tuple[float, ...] = ()
    # P(accepted | the draft's probability for the token), by bucket of that probability
    # (acceptance.Calibration): the path estimate is the product of these along the path. Empty: the
    # draft's own cumulative probability is the estimate (a draft assumed calibrated).
    calib: tuple[float, ...] = ()

    def stop_at(self, level: int) -> float:
        """The path estimate below which the drafter stops after `level` levels."""
        return self.stop_levels[level - 1] if 0 < level <= len(self.stop_levels) else self.stop_prob

    def accept_estimate(self, p: float) -> float:
        """The acceptance estimate of a drafted token to which the draft gave probability p."""
        c = self.calib
        return c[calib_bucket(p, len(c))] if c else p

    @property
    def verify_tokens(self) -> int:
        return self.nodes + 1

    @property
    def kind(self) -> str:
        """plain | chain | runner_ups | eagle — finer than `mode`, for stats."""
        if self.mode == "tree":
            return "runner_ups" if self.runner_ups > 0 else "eagle"
        return self.mode

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "kind": self.kind,
            "depth": self.depth,
            "width": self.width,
            "nodes": self.nodes,
            "runner_ups": self.runner_ups,
            "expand": self.expand,
            "stop_prob": self.stop_prob,
            **({"stop_levels": [round(x, 4) for x in self.stop_levels]} if self.stop_levels else {}),
        }


PLAIN = Shape("plain")


def chain(depth: int, stop_prob: float = 0.0) -> Shape:
    return Shape("chain", depth=depth, width=1, nodes=depth, stop_prob=stop_prob)


def runner_ups(depth: int, r: int, stop_prob: float = 0.0) -> Shape:
    return Shape("tree", depth=depth, width=1 + r, nodes=depth * (1 + r), runner_ups=r, expand=1, stop_prob=stop_prob)


def eagle(depth: int, width: int, expand: int, nodes: int, stop_prob: float = 0.0) -> Shape:
    return Shape("tree", depth=depth, width=width, nodes=nodes, runner_ups=0, expand=expand, stop_prob=stop_prob)


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
