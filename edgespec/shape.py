"""What a step speculates: `Shape` (plain, a chain, chain + runner-ups, an EAGLE-2 tree) and
its constructors. Below every package that needs it: the controller chooses shapes, the
schedule prices them, the drafters grow trees to them."""

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
    # P(accepted | the draft's probability for the token), by bucket of that probability
    # (acceptance.Calibration): the path estimate is the product of these along the path. Empty: the
    # draft's own cumulative probability is the estimate (a draft assumed calibrated).
    calib: tuple[float, ...] = ()

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
        }


PLAIN = Shape("plain")


def chain(depth: int, stop_prob: float = 0.0) -> Shape:
    return Shape("chain", depth=depth, width=1, nodes=depth, stop_prob=stop_prob)


def runner_ups(depth: int, r: int, stop_prob: float = 0.0) -> Shape:
    return Shape("tree", depth=depth, width=1 + r, nodes=depth * (1 + r), runner_ups=r, expand=1, stop_prob=stop_prob)


def eagle(depth: int, width: int, expand: int, nodes: int, stop_prob: float = 0.0) -> Shape:
    return Shape("tree", depth=depth, width=width, nodes=nodes, runner_ups=0, expand=expand, stop_prob=stop_prob)
