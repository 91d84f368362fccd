"""Tree growth shared by the drafters that decode: a candidate tree grown level by level, one
draft forward per level (EAGLE-2's dynamic expansion).

Each level gives the nodes decoded last their top-`width` children; the next level decodes the
`expand` frontier nodes of highest cumulative draft probability. At T = 0 children are the
draft's greedy top-k and the final tree keeps the `nodes` nodes of highest cumulative draft
probability. At T > 0 children are drawn without replacement from the draft's distribution
(Gumbel-top-k), kept in draw order, and the node budget is spent in that order with no
re-ranking: whether a node gets a candidate child may depend on everything drafted before that
candidate, never on the candidate itself (exactness under recursive rejection sampling).

Draft KV: the committed context lives in seq 0 up to the root's row at `root_pos`; a decoded
node's cells live in the seq of its branch: the first expanded child of a node inherits its
parent's seq, later ones get a copy (`assign_seqs`).

A drafter drives it as a generator (`grow_steps`): it yields the batch of each level and is sent
that batch's rows back.
"""

from __future__ import annotations

import numpy as np

from edgespec.drafters.base import DraftReport
from edgespec.sampling import SamplingParams, logits_to_probs
from edgespec.shape import Shape
from edgespec.tree import DraftTree


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max())
    return z / z.sum()


def _gumbel_topk(q: np.ndarray, k: int, rng: np.random.Generator) -> list[int]:
    """k draws without replacement from q, in draw order (the Gumbel-top-k trick)."""
    support = np.flatnonzero(q > 0)
    k = min(k, len(support))
    if k == 0:
        return []
    keys = np.log(q[support]) + rng.gumbel(size=len(support))
    top = np.argpartition(-keys, k - 1)[:k] if k < len(support) else np.arange(len(support))
    top = top[np.argsort(-keys[top])]
    return [int(support[i]) for i in top]


class Growth:
    """One step's candidate tree; node 0 = the root. `logits[i]` (and for a head `hidden[i]`)
    are node i's draft output once decoded."""

    def __init__(self, root: int, root_logits: np.ndarray, shape: Shape, sampling: SamplingParams,
                 rng: np.random.Generator, kv, n_seq: int, root_pos: int, mask=None, adjust=None):
        self.shape, self.sampling, self.rng, self.mask = shape, sampling, rng, mask
        self.adjust = adjust  # (logits, path) -> logits: the request's bias and penalties
        self.kv, self.n_seq, self.root_pos = kv, n_seq, root_pos
        self.greedy = sampling.greedy
        self.parent = [-1]
        self.token = [root]
        self.cum = [1.0]  # cumulative draft probability: ranks the frontier and the kept nodes
        self.est = [1.0]  # the path's acceptance estimate (shape.accept_estimate along it): the stop rule
        self.dep = [0]
        self.qs: list[np.ndarray | None] = [None]
        self.spine_nodes: list[int] = []  # the path of first choices from the root (root excluded)
        self.logits: dict[int, np.ndarray] = {0: root_logits}
        self.hidden: dict[int, np.ndarray] = {}
        self.seq_of: dict[int, int] = {0: 0}
        self.used = {0}
        self.budget = shape.nodes

    def path(self, n: int) -> list[int]:
        """The drafted tokens from below the root down to node n."""
        out = []
        while n > 0:
            out.append(self.token[n])
            n = self.parent[n]
        return out[::-1]

    def children(self, nodes: list[int], level: int, rep: DraftReport) -> list[int]:
        """Give each of `nodes` (decoded) its children; returns the new nodes."""
        shape, greedy = self.shape, self.greedy
        width = max(1, shape.width)
        new: list[int] = []
        for n in nodes:
            if not greedy and self.budget <= 0:
                break
            lg = self.logits[n]
            if self.adjust is not None:  # draw from the draft as the target will be read there
                lg = self.adjust(lg, self.path(n))
            if self.mask is not None:
                allowed = self.mask(self.path(n))
                if not allowed.any():
                    continue
                lg = np.where(allowed, lg, -np.inf)
            if greedy:
                k = min(width, int(np.isfinite(lg).sum()))
                top: np.ndarray | list[int] = []
                if k:
                    top = np.argpartition(-lg, k - 1)[:k]
                    top = top[np.argsort(-lg[top])]
                pr = _softmax(lg)
                kids = [(int(t), float(pr[t])) for t in top if pr[t] > 0]
            else:
                q = logits_to_probs(lg, self.sampling)
                self.qs[n] = q
                kids = [(t, float(q[t])) for t in _gumbel_topk(q, min(width, self.budget), self.rng)]
            if kids and n == (self.spine_nodes[-1] if self.spine_nodes else 0):
                rep.spine_probs.append(kids[0][1])
                self.spine_nodes.append(len(self.token))  # the first kid, appended next
            for t, pt in kids:
                self.parent.append(n)
                self.token.append(t)
                self.cum.append(self.cum[n] * pt)
                self.est.append(self.est[n] * shape.accept_estimate(pt))
                self.qs.append(None)
                self.dep.append(level)
                new.append(len(self.token) - 1)
                self.budget -= 1
        return new

    def frontier(self, new: list[int], level: int, depth: int) -> list[int]:
        """The nodes the next level decodes ([] when growth stops here)."""
        shape = self.shape
        if level == depth or not new or (not self.greedy and self.budget <= 0):
            return []
        stop = shape.stop_at(level)
        if stop > 0 and max(self.est[i] for i in new) < stop:
            return []
        return sorted(new, key=lambda i: -self.cum[i])[: max(1, shape.expand)]

    def assign_seqs(self, nodes: list[int]) -> list[int]:
        """A draft seq per node to decode: the first child of a node inherits its parent's seq; the
        others get a free seq holding a copy of the parent's (prefix + ancestors)."""
        seq_of, used, kv = self.seq_of, self.used, self.kv
        claimed: set[int] = set()
        out: list[int | None] = [None] * len(nodes)
        for j, i in enumerate(nodes):
            s = seq_of[self.parent[i]]
            if s not in claimed:
                claimed.add(s)
                out[j] = s
        live_parents = {seq_of[self.parent[i]] for i in nodes}
        free = [s for s in range(self.n_seq) if s not in claimed and s not in live_parents]
        for j, i in enumerate(nodes):
            if out[j] is None:
                if not free:
                    raise ValueError(f"the tree needs more than the draft context's {self.n_seq} sequences")
                s = free.pop(0)
                src = seq_of[self.parent[i]]
                if s in used:  # recycle a dead branch's seq: its nodes no longer have cells there
                    for node in [n for n, ns in seq_of.items() if ns == s]:
                        del seq_of[node]
                    kv.seq_rm(s, self.root_pos + 1, -1)
                    kv.seq_cp(src, s, self.root_pos + 1, -1)
                else:
                    kv.seq_cp(src, s, -1, -1)
                    used.add(s)
                out[j] = s
        seqs = [s for s in out if s is not None]
        assert len(seqs) == len(nodes)  # every node has its sequence now
        for i, s in zip(nodes, seqs):
            seq_of[i] = s
        return seqs

    def build(self, tree: DraftTree, max_leaves: int, rep: DraftReport) -> dict[int, int]:
        """Copy the candidates into `tree` (a lone root); returns candidate -> tree node. At T = 0
        the best `nodes` by cumulative draft probability are kept."""
        greedy, parent = self.greedy, self.parent
        order = list(range(1, len(self.token)))
        if greedy and len(order) > self.shape.nodes:
            order = sorted(order, key=lambda i: (-self.cum[i], self.dep[i], i))[: self.shape.nodes]
            order.sort()
        remap = {0: 0}
        assert len(tree) == 1, "the drafter grows the tree first"
        if not greedy:
            tree.q[0] = self.qs[0]
        leaves = 0
        has_child: set[int] = set()
        for i in order:
            p = parent[i]
            if p not in remap:
                continue  # its parent was left out
            if p in has_child and leaves >= max_leaves:
                # a second child would add a leaf (a sequence of the slot's range): the tree
                # stops growing sideways here. Decided in `order` (draw order at T > 0), so it
                # never depends on the candidate's own value.
                continue
            if p in has_child or p == 0:
                leaves += 1
            has_child.add(p)
            remap[i] = tree.add(remap[p], self.token[i], point=greedy)
            if not greedy:
                tree.q[remap[i]] = self.qs[i]
        for k, i in enumerate(self.spine_nodes):  # first choices verification will not see
            if i not in remap:
                del rep.spine_probs[k:]
                break
        return remap


def grow_steps(g: Growth, depth: int, rep: DraftReport, batch_of, store):
    """Grow `g` level by level as a generator: `batch_of(nodes, seqs)` is the draft batch that
    decodes `nodes` in `seqs`; it is yielded and sent back its rows, which `store(nodes, rows)`
    keeps in `g`."""
    expand_now = [0]
    for level in range(1, depth + 1):
        rep.levels = level
        new = g.children(expand_now, level, rep)
        expand_now = g.frontier(new, level, depth)
        if not expand_now:
            break
        rows = yield batch_of(expand_now, g.assign_seqs(expand_now))
        rep.batches.append(len(expand_now))
        store(expand_now, rows)
