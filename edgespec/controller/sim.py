"""A scripted drafter and a step simulator: StepOutcomes from a per-step acceptance script and a
"true" cost model, for testing the controller's dynamics and for what-if reports. Pure and seeded.

The simulated drafter's candidates at depth d (0-based) and sibling position k are accepted with
probability a_true[d][k] = top1(step) * rank_scale[k]; the tree a shape describes is built as the
engine would build it (EAGLE-2 trees rank nodes by cumulative probability, here the true one).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from edgespec.controller.controller import Controller
from edgespec.controller.cost import CostModel
from edgespec.controller.policy import sibling_probs
from edgespec.controller.shapes import Shape, StepOutcome, plain_outcome

RANK_SCALE = (1.0, 0.45, 0.4, 0.33, 0.25, 0.25, 0.25, 0.25)

# Seconds per forward by batch size, from the measured CPU curves (2 threads, SmolLM2-135M), and a
# GPU-like pair where verifying 32 tokens costs about as much as 1 and drafting is cheap.
CPU_TARGET_F32 = {1: 0.036, 2: 0.036, 4: 0.047, 8: 0.065, 16: 0.080}
CPU_DRAFT_Q4_0 = {1: 0.011, 2: 0.015, 4: 0.022, 8: 0.036, 16: 0.064}
GPU_TARGET = {1: 0.010, 2: 0.010, 4: 0.010, 8: 0.0102, 16: 0.0105, 32: 0.011, 64: 0.014, 128: 0.02}
GPU_DRAFT = {1: 0.002, 2: 0.002, 4: 0.002, 8: 0.0021, 16: 0.0022, 32: 0.0024}


def cpu_cost(alpha: float = 0.1) -> CostModel:
    return CostModel.from_tables(CPU_TARGET_F32, CPU_DRAFT_Q4_0, alpha)


def gpu_cost(alpha: float = 0.1) -> CostModel:
    return CostModel.from_tables(GPU_TARGET, GPU_DRAFT, alpha)


def build_tree(shape: Shape, p: list[list[float]]) -> list[list[int]]:
    """children[node] (node 0 = root), each list ordered by sibling rank; node depth = its level."""
    if shape.mode == "chain":
        return [[i + 1] for i in range(shape.depth)] + [[]]
    if shape.runner_ups:
        kids: list[list[int]] = [[]]
        spine = 0
        for _ in range(shape.depth):
            first = len(kids)
            kids[spine] = list(range(first, first + 1 + shape.runner_ups))
            kids.extend([] for _ in range(1 + shape.runner_ups))
            spine = first
        return kids
    # EAGLE-2: grow `depth` levels expanding the `expand` best frontier nodes, keep the `nodes` best
    nodes = [(1.0, -1, 0)]  # (value, parent, depth)
    frontier = [0]
    for d in range(shape.depth):
        parents = sorted(frontier, key=lambda i: -nodes[i][0])[: shape.expand] if d else [0]
        frontier = []
        for par in parents:
            for k in range(shape.width):
                nodes.append((nodes[par][0] * p[d][k], par, d + 1))
                frontier.append(len(nodes) - 1)
    keep = sorted(range(1, len(nodes)), key=lambda i: (-nodes[i][0], nodes[i][2], i))[: shape.nodes]
    keep_set = set(keep) | {0}
    keep = [i for i in keep if nodes[i][1] in keep_set]  # prefix-closed
    remap = {0: 0}
    for i in sorted(keep):
        remap[i] = len(remap)
    kids = [[] for _ in remap]
    for i in sorted(keep):
        kids[remap[nodes[i][1]]].append(remap[i])
    return kids


@dataclass
class ScriptedDrafter:
    """top1(step) -> the draft's top-1 acceptance at this step; runner-ups scaled by rank_scale."""

    top1: Callable[[int], float]
    rank_scale: tuple[float, ...] = RANK_SCALE

    def acceptance(self, step: int, depths: int = 16) -> list[list[float]]:
        t = min(1.0, max(0.0, self.top1(step)))
        return [[min(1.0, t * s) for s in self.rank_scale] for _ in range(depths)]


@dataclass
class SimResult:
    tokens: int = 0
    seconds: float = 0.0
    plain_seconds: float = 0.0  # what plain decoding of the same tokens would have cost
    steps: int = 0
    states: list[str] = field(default_factory=list)  # [step] breaker state when the step was chosen
    kinds: list[str] = field(default_factory=list)  # [step] shape kind
    draft_forwards: list[int] = field(default_factory=list)  # [step]

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds if self.seconds else 0.0


def simulate(ctrl: Controller, drafter: ScriptedDrafter, true_cost: CostModel, *, steps: int | None = None,
             tokens: int | None = None, seed: int = 0, backlog_cap: int | None = 0) -> SimResult:
    """Run the controller for `steps` steps (or until `tokens` tokens).

    backlog_cap: draft catch-up after a plain phase. 0 = free (open = zero drafting cost, as if the
    engine kept the draft in sync for free); n = the first speculative step after plain decoding
    re-feeds min(backlog, n) tokens to the draft; None = the whole backlog.
    """
    rng = random.Random(seed)
    res = SimResult()
    backlog, prev_full = 0, False
    while (steps is None or res.steps < steps) and (tokens is None or res.tokens < tokens):
        state = ctrl.state
        shape = ctrl.choose()
        res.states.append(state)
        res.kinds.append(shape.kind)
        if shape.mode == "plain":
            secs = true_cost.verify_seconds(1)
            out = plain_outcome(secs)
            backlog += 1
            res.draft_forwards.append(0)
        else:
            a = drafter.acceptance(res.steps)
            kids = build_tree(shape, sibling_probs(a))
            node, depth, ranks, offered = 0, 0, [], []
            while True:
                ch = kids[node]
                offered.append(len(ch))
                for k, c in enumerate(ch):
                    if rng.random() < a[depth][k]:
                        ranks.append(k)
                        node, depth = c, depth + 1
                        break
                else:
                    break
            n_nodes = len(kids) - 1
            first = 1 + (1 if prev_full else 0)
            if backlog:
                first += backlog if backlog_cap is None else min(backlog, backlog_cap)
            batches = [first]
            if shape.runner_ups or shape.mode == "chain":
                batches += [1] * (shape.depth - 1)
            else:
                width = [len(k) for k in kids if k]
                level, lvl_nodes = 1, kids[0]
                while level < shape.depth and lvl_nodes:
                    expanded = [n for n in lvl_nodes if kids[n]]
                    if not expanded:
                        break
                    batches.append(len(expanded))
                    lvl_nodes = [c for n in expanded for c in kids[n]]
                    level += 1
                del width
            dsecs = sum(true_cost.draft_seconds(b) if i == 0 else true_cost.expand_seconds(b)
                        for i, b in enumerate(batches))
            vsecs = true_cost.verify_seconds(n_nodes + 1)
            out = StepOutcome(shape, tuple(ranks), tuple(offered), len(ranks) + 1, dsecs, tuple(batches),
                              vsecs, n_nodes + 1, len(batches))
            prev_full = len(ranks) == shape.depth
            backlog = 0
            secs = dsecs + vsecs
            res.draft_forwards.append(len(batches))
        ctrl.observe(out)
        res.steps += 1
        res.tokens += out.emitted
        res.seconds += secs
        res.plain_seconds += out.emitted * true_cost.verify_seconds(1)
    return res
