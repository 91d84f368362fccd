"""Expected tokens and seconds of candidate shapes; the argmax of their ratio.

With a[d][r] from the acceptance model, p[d][r] = a[d][r] * prod_{j<r} (1 - a[d][j]) is the
probability that the rank-r child at depth d is THE accepted child, given its parent was reached.
Under independence across depths, a node's path value v(node) = prod of p along its path is the
probability that verification accepts it, so E[accepted] = sum of v over the verified nodes and
E[tokens] = 1 + E[accepted] (the bonus/recovered token).

- chain(k):            E = 1 + sum_{k'<=k} prod_{i<=k'} a[i][0]
- chain + r runner-ups: E = 1 + sum_{k'<=k} (prod_{i<k'} a[i][0]) * (1 - prod_{j<=r} (1 - a[k'][j]))
  (only the rank-0 child continues the chain)
- EAGLE-2 (depth D, width W, expand E, nodes N): the tree is grown as the drafter grows it, with the
  approximation that the draft's cumulative probability ranks nodes like v does: level 1 = the root's
  W children; each level expands the E frontier nodes of highest v into W children; the N nodes of
  highest v over all levels are verified; E[accepted] = sum of those N values.

Expected seconds = draft forwards + verify_seconds(nodes + 1) + the per-step overhead:
draft forward 1 has batch `catchup` (tokens the draft must absorb: the root plus what it lacks from
the last step, measured; logits of the last only), forward l > 1 has batch = nodes expanded at
level l - 1 (1 for chains), each with its logits (`CostModel.expand_seconds`).
Without a draft model the only drafter is the model-free n-gram lookup: chains with zero draft cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from edgespec.controller.config import ControllerConfig
from edgespec.controller.cost import CostModel
from edgespec.shape import PLAIN, Shape, chain, eagle, runner_ups

EAGLE_WE = ((2, 2), (2, 4), (4, 2), (4, 4), (4, 8))  # (width, expand) families tried
EAGLE_DEPTHS = (2, 3, 4, 5, 6, 8, 10, 12)
EAGLE_NODES = (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
MAX_RUNNER_UPS = 3


@dataclass(frozen=True)
class Choice:
    shape: Shape
    tokens: float  # expected tokens emitted by the step
    seconds: float  # expected seconds of the step
    rate: float  # tokens / seconds
    plain_rate: float
    evaluated: int  # candidates evaluated
    # tokens the verification forward is priced at: nodes + 1, or the wider width it pads up to
    # where that costs less (CostModel.pad_to)
    verify_width: int = 1

    @property
    def speedup(self) -> float:
        return self.rate / self.plain_rate if self.plain_rate > 0 else 0.0


def sibling_probs(a: list[list[float]]) -> list[list[float]]:
    """p[d][r] = a[d][r] * prod_{j<r} (1 - a[d][j])."""
    out = []
    for row in a:
        rest, prow = 1.0, []
        for x in row:
            prow.append(rest * x)
            rest *= 1.0 - x
        out.append(prow)
    return out


def chain_tokens(a: list[list[float]], depth: int) -> float:
    e, reach = 1.0, 1.0
    for d in range(depth):
        reach *= a[d][0]
        e += reach
    return e


def runner_ups_tokens(a: list[list[float]], depth: int, r: int) -> float:
    e, reach = 1.0, 1.0
    for d in range(depth):
        miss = 1.0
        for j in range(r + 1):
            miss *= 1.0 - a[d][j]
        e += reach * (1.0 - miss)
        reach *= a[d][0]
    return e


def expansion_batches(shape: Shape, a: list[list[float]] | None = None) -> tuple[int, ...]:
    """The draft batch of each forward after the first (levels 2..depth) of `shape`. An EAGLE-2
    tree expands where acceptance `a` is high (None: as if flat)."""
    if shape.mode == "plain" or shape.depth <= 1:
        return ()
    if shape.mode == "chain" or shape.runner_ups:
        return (1,) * (shape.depth - 1)
    p = sibling_probs(a) if a is not None else [[0.5] * shape.width] * shape.depth
    return tuple(eagle_levels(p, shape.width, shape.expand, shape.depth)[1])


def eagle_levels(p: list[list[float]], width: int, expand: int, depth: int) -> tuple[list[list[float]], list[int]]:
    """Node values per level (levels 1..depth) and the draft batch of forwards 2..depth."""
    level = p[0][:width]
    levels, batches = [level], []
    for d in range(1, depth):
        parents = sorted(level, reverse=True)[:expand]
        batches.append(len(parents))
        row = p[d][:width]
        level = [v * q for v in parents for q in row]
        levels.append(level)
    return levels, batches


class ShapePolicy:
    """The candidate set of one request (fixed at construction) and its evaluation."""

    def __init__(self, cfg: ControllerConfig, *, max_depth: int, max_nodes: int,
                 has_draft_model: bool = True, max_leaves: int | None = None):
        self.cfg = cfg
        self.max_depth = max(1, min(cfg.max_depth, max_depth))
        self.min_depth = min(cfg.min_depth, self.max_depth)
        self.max_nodes = max(1, min(cfg.max_nodes, max_nodes))
        self.max_depth = min(self.max_depth, self.max_nodes)  # a chain of depth k verifies k nodes
        self.max_width = cfg.max_width
        self.has_draft_model = has_draft_model
        self.max_leaves = max_leaves
        lo, hi = self.min_depth, self.max_depth
        self.chain_depths = list(range(lo, hi + 1)) if (cfg.enable_chain and has_draft_model) or (
            not has_draft_model and cfg.enable_ngram) else []
        self.runner_ups: list[tuple[int, int]] = []  # (depth, r)
        self.eagle: list[tuple[int, int, list[tuple[int, list[int]]]]] = []  # (width, expand, [(depth, [nodes])])
        if has_draft_model and cfg.enable_runner_ups:
            for r in range(1, min(MAX_RUNNER_UPS, self.max_width - 1) + 1):
                for d in range(lo, hi + 1):
                    if d * (1 + r) <= self.max_nodes and self._leaves_ok(d * r + 1):
                        self.runner_ups.append((d, r))
        if has_draft_model and cfg.enable_tree:
            for w, e in EAGLE_WE:
                if w > self.max_width:
                    continue
                per_depth = []
                for d in EAGLE_DEPTHS:
                    if not lo <= d <= hi:
                        continue
                    total = w + sum(min(e, w ** (k)) * w for k in range(1, d))  # nodes generated
                    ns = sorted({n for n in EAGLE_NODES if d < n < total and n <= self.max_nodes}
                                | ({total} if total <= self.max_nodes else set()))
                    leaves_bound = w + sum(min(e, w ** k) * (w - 1) for k in range(1, d))
                    ns = [n for n in ns if self._leaves_ok(min(n, leaves_bound))]
                    if ns:
                        per_depth.append((d, ns))
                if per_depth:
                    self.eagle.append((w, e, per_depth))
        self.n_candidates = len(self.chain_depths) + len(self.runner_ups) + sum(
            len(ns) for _, _, pd in self.eagle for _, ns in pd)

    def _leaves_ok(self, leaves: int) -> bool:
        return self.max_leaves is None or leaves <= self.max_leaves

    @property
    def has_speculative(self) -> bool:
        return self.n_candidates > 0

    def probe_shape(self) -> Shape:
        d = min(max(self.cfg.probe_depth, self.min_depth), self.max_depth)
        if self.chain_depths:
            return chain(d)
        if self.runner_ups:
            return runner_ups(*min(self.runner_ups, key=lambda x: (abs(x[0] - d), x[1])))
        if self.eagle:
            w, e, per_depth = self.eagle[0]
            dd, ns = per_depth[0]
            return eagle(dd, w, e, ns[0], self.cfg.stop_prob)
        return PLAIN

    def best(self, a: list[list[float]], cost: CostModel, *, catchup: int = 1,
             overhead_spec: float = 0.0, overhead_plain: float = 0.0) -> Choice:
        """argmax over the speculative candidates of E[tokens] / E[seconds] (plain is the baseline)."""
        verify = cost.curve("target")  # the memoised lookup itself (hot loop)
        plain_rate = 1.0 / (verify(1) + overhead_plain)
        draft1 = cost.draft_seconds(max(1, catchup)) if self.has_draft_model else 0.0
        step = cost.draft_seconds(1) if self.has_draft_model else 0.0
        sp = self.cfg.stop_prob
        best_rate, best = -1.0, (PLAIN, 1.0, 1.0 / plain_rate)
        n = 0

        # chains: one pass over depth
        if self.chain_depths:
            e, reach = 1.0, 1.0
            for d in range(self.max_depth):
                reach *= a[d][0]
                e += reach
                k = d + 1
                if k < self.min_depth:
                    continue
                secs = draft1 + (k - 1) * step + verify(k + 1) + overhead_spec
                n += 1
                if e / secs > best_rate:
                    best_rate, best = e / secs, (chain(k, sp), e, secs)

        # chain + runner-ups: one pass over depth per r
        by_r: dict[int, list[int]] = {}
        for d, r in self.runner_ups:
            by_r.setdefault(r, []).append(d)
        for r, depths in by_r.items():
            depth_set = set(depths)
            e, reach = 1.0, 1.0
            for d in range(max(depths)):
                row = a[d]
                miss = 1.0
                for j in range(r + 1):
                    miss *= 1.0 - row[j]
                e += reach * (1.0 - miss)
                reach *= row[0]
                k = d + 1
                if k in depth_set:
                    secs = draft1 + (k - 1) * step + verify(k * (1 + r) + 1) + overhead_spec
                    n += 1
                    if e / secs > best_rate:
                        best_rate, best = e / secs, (runner_ups(k, r, sp), e, secs)

        # EAGLE-2 trees: grow levels once per (width, expand); for each depth, one sort gives all budgets
        if self.eagle:
            p = sibling_probs(a)
            for w, ex, per_depth in self.eagle:
                dmax = per_depth[-1][0]
                want = dict(per_depth)
                top_n = max(ns[-1] for _, ns in per_depth)
                level = p[0][:w]
                srt = sorted(level, reverse=True)  # the top_n node values so far, descending
                dsecs = draft1
                for d in range(1, dmax + 1):
                    if d > 1:
                        parents = sorted(level, reverse=True)[:ex] if len(level) > ex else level
                        dsecs += cost.expand_seconds(len(parents))
                        row = p[d - 1][:w]
                        level = [v * q for v in parents for q in row]
                        srt = sorted(srt + level, reverse=True)[:top_n]
                    ns = want.get(d)
                    if not ns:
                        continue
                    cum = list(accumulate(srt))
                    last = len(cum) - 1
                    for nodes in ns:
                        e = 1.0 + cum[nodes - 1 if nodes <= last else last]
                        secs = dsecs + verify(nodes + 1) + overhead_spec
                        n += 1
                        if e / secs > best_rate:
                            best_rate, best = e / secs, (eagle(d, w, ex, nodes, sp), e, secs)

        shape, e, secs = best
        return Choice(shape, e, secs, e / secs, plain_rate, n, cost.pad_to(shape.verify_tokens))

    def stop_levels(self, shape: Shape, a: list[list[float]], cost: CostModel, rate: float) -> tuple[float, ...]:
        """Per level of a chain, the path estimate below which drafting the next level stops paying:
        level j + 1 costs one draft forward and the verification's extra width, and is worth its
        token's acceptance (a[j][0]) times the path estimate, at the step's `rate` (tokens per
        second) that many seconds. So the threshold is marginal seconds x rate / a[j][0], capped at
        `stop_prob` (the setting stays the most it may be). Where drafting is dear against a
        forward (a draft a third of the target's cost) that is stop_prob itself; with a cheap draft
        and a verification whose cost steps (a CPU's 4-token kernels) it is lower: a chain does
        not stop short where its next token costs little. Other shapes: () (stop_prob)."""
        if shape.mode != "chain" or shape.stop_prob <= 0 or rate <= 0 or shape.depth < 2:
            return ()
        verify = cost.verify_seconds
        step = cost.draft_seconds(1) if self.has_draft_model else 0.0
        out = []
        for j in range(1, shape.depth):
            marginal = step + max(0.0, verify(j + 2) - verify(j + 1))
            out.append(min(shape.stop_prob, marginal * rate / max(a[j][0], 0.05)))
        return tuple(out)

    def evaluate(self, shape: Shape, a: list[list[float]], cost: CostModel, *, catchup: int = 1,
                 overhead_spec: float = 0.0, overhead_plain: float = 0.0) -> tuple[float, float]:
        """(E[tokens], E[seconds]) of one given shape (used by tests and the simulator's reports)."""
        verify = cost.verify_seconds
        if shape.mode == "plain":
            return 1.0, verify(1) + overhead_plain
        draft1 = cost.draft_seconds(max(1, catchup)) if self.has_draft_model else 0.0
        step = cost.draft_seconds(1) if self.has_draft_model else 0.0
        if shape.mode == "chain":
            return chain_tokens(a, shape.depth), draft1 + (shape.depth - 1) * step + verify(shape.nodes + 1) + overhead_spec
        if shape.runner_ups:
            e = runner_ups_tokens(a, shape.depth, shape.runner_ups)
            return e, draft1 + (shape.depth - 1) * step + verify(shape.nodes + 1) + overhead_spec
        levels, batches = eagle_levels(sibling_probs(a), shape.width, shape.expand, shape.depth)
        values = sorted((v for lv in levels for v in lv), reverse=True)[: shape.nodes]
        secs = draft1 + sum(cost.expand_seconds(b) for b in batches) + verify(shape.nodes + 1) + overhead_spec
        return 1.0 + sum(values), secs
