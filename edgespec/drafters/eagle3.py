"""The EAGLE-3 drafter: a one-layer head over the target's own features drafts the tree.

Head position P holds the pair (token[P+1], g[P]) (llama.cpp's convention), so the head is one
token behind the target: with context tokens[0..L-1] (root = tokens[L-1]), seq 0 holds head
positions 0..L-2, each with g = fc(the target's features at P), and the output at L-2 gives the
root's children. A drafted node at depth d sits at head position L-2+d with the node's token
and, for g, its parent's pre-norm output (the head's guess of the target's features there).

Per step, in this order:
  propose(tree, tokens, ...)  decodes the positions whose features arrived since (one head
                              forward), then grows the tree level by level (one head forward per
                              level: the `expand` frontier nodes of highest cumulative draft
                              probability, top-`width` children each);
  accept(tree, accepted, tokens)  drops every drafted cell (they were computed from guessed g);
  add_features(features)      the target's features of the rows it just decoded whose context
                              indices come next: after a prefill chunk, its rows; after a
                              verification, the root's row and each accepted node's, in path order.

The tree follows ModelDrafter's rules: at T = 0 greedy top-k children, EAGLE-2 re-ranking by
cumulative draft probability; at T > 0 children drawn without replacement from the head's
distribution (Gumbel-top-k), in draw order, no re-ranking (exactness needs shapes that never
depend on a candidate's own value).

KV: seq 0 = committed head positions 0..n_past-1; a decoded node's cells live in its branch's
seq (the first expanded child of a node inherits its parent's seq, later ones get a copy); after
`accept` every seq but 0 is empty and seq 0 ends at n_past-1 (`check_kv`).
"""

from __future__ import annotations

import time

import numpy as np

from edgespec.backend import HeadContext
from edgespec.controller.shapes import Shape
from edgespec.drafters.base import DraftReport
from edgespec.drafters.model import _gumbel_topk, _softmax
from edgespec.sampling import SamplingParams, logits_to_probs
from edgespec.tree import DraftTree


class Eagle3Drafter:
    name = "eagle3"

    def __init__(self, head: HeadContext):
        self.head = head
        self.n_seq = head.n_seq_max
        self.n_past = 0  # head positions committed in seq 0
        self._g: list[np.ndarray] = []  # g rows for head positions n_past, n_past + 1, ...
        self._root: tuple[int, np.ndarray, np.ndarray] | None = None  # (position, logits, hidden) of the last committed position
        self._used_seqs: set[int] = set()

    @property
    def n_features(self) -> int:
        """Context indices whose target features the head has (n_past + pending)."""
        return self.n_past + sum(len(g) for g in self._g)

    def begin(self, tokens: list[int]) -> None:
        self.head.clear()
        self.n_past = 0
        self._g = []
        self._root = None
        self._used_seqs = set()

    def add_features(self, features: np.ndarray) -> None:
        """[n, 3 * target n_embd] target features of the next n context indices (rows of the
        target forward that decoded them: FeatureContext.features(rows))."""
        if len(features):
            self._g.append(self.head.encode(features))

    def _catch_up(self, tokens: list[int]) -> int:
        """Write head positions n_past..L-2 into seq 0 (token[P+1], g[P]); returns how many."""
        L = len(tokens)
        if self.n_features != L - 1:
            raise ValueError(f"the head has target features for {self.n_features} context tokens, needs "
                             f"{L - 1} (all but the root): add_features after every target forward")
        if not self._g:
            return 0
        g = np.concatenate(self._g)
        self._g = []
        start = self.n_past
        n_batch = self.head.n_batch
        for s in range(0, len(g), n_batch):
            m = min(n_batch, len(g) - s)
            p0 = start + s
            self.head.decode(tokens[p0 + 1:p0 + 1 + m], range(p0, p0 + m), [(0,)] * m, g[s:s + m],
                             [False] * (m - 1) + [s + m == len(g)])
        self.n_past = L - 1
        self._root = (L - 2, self.head.logits(-1).copy(), self.head.hidden(-1).copy())
        return len(g)

    def propose(self, tree: DraftTree, tokens: list[int], shape: Shape, sampling: SamplingParams,
                rng: np.random.Generator) -> DraftReport:
        t0 = time.perf_counter()
        rep = DraftReport()
        head = self.head
        L = len(tokens)
        rep.batches.append(self._catch_up(tokens))
        depth = min(shape.depth, head.n_ctx - L)
        if depth <= 0 or shape.nodes <= 0 or L < 2 or self._root is None or self._root[0] != L - 2:
            return rep
        base_pos = L - 2  # head position of the root's output
        greedy = sampling.greedy
        parent, token, dep = [-1], [tokens[-1]], [0]
        cum, est = [1.0], [1.0]
        qs: list[np.ndarray | None] = [None]
        spine_nodes: list[int] = []
        logits = {0: self._root[1]}
        hidden = {0: self._root[2]}
        seq_of: dict[int, int] = {0: 0}
        used = {0}
        expand_now = [0]
        budget = shape.nodes
        width = max(1, shape.width)
        for level in range(1, depth + 1):
            rep.levels = level
            new: list[int] = []
            for n in expand_now:
                if not greedy and budget <= 0:
                    break
                lg = logits[n]
                if greedy:
                    k = min(width, int(np.isfinite(lg).sum()))
                    top = np.argpartition(-lg, k - 1)[:k]
                    top = top[np.argsort(-lg[top])]
                    pr = _softmax(lg)
                    kids = [(int(t), float(pr[t])) for t in top]
                else:
                    q = logits_to_probs(lg, sampling)
                    qs[n] = q
                    kids = [(t, float(q[t])) for t in _gumbel_topk(q, min(width, budget), rng)]
                if kids and n == (spine_nodes[-1] if spine_nodes else 0):
                    rep.spine_probs.append(kids[0][1])
                    spine_nodes.append(len(token))
                for t, pt in kids:
                    parent.append(n)
                    token.append(t)
                    cum.append(cum[n] * pt)
                    est.append(est[n] * shape.accept_estimate(pt))
                    qs.append(None)
                    dep.append(level)
                    new.append(len(token) - 1)
                    budget -= 1
            if level == depth or not new or (not greedy and budget <= 0):
                break
            if shape.stop_prob > 0 and max(est[i] for i in new) < shape.stop_prob:
                break
            frontier = sorted(new, key=lambda i: -cum[i])
            expand_now = frontier[: max(1, shape.expand)]
            seqs = self._assign_seqs(expand_now, parent, seq_of, used, base_pos)
            head.decode([token[i] for i in expand_now], [base_pos + dep[i] for i in expand_now],
                        [(s,) for s in seqs], np.stack([hidden[parent[i]] for i in expand_now]),
                        [True] * len(expand_now))
            rep.batches.append(len(expand_now))
            for j, i in enumerate(expand_now):
                logits[i] = head.logits(j).copy()
                hidden[i] = head.hidden(j).copy()

        order = list(range(1, len(token)))
        if greedy and len(order) > shape.nodes:
            order = sorted(order, key=lambda i: (-cum[i], dep[i], i))[: shape.nodes]
            order.sort()
            kept = set(order)
            for k, i in enumerate(spine_nodes):
                if i not in kept:
                    del rep.spine_probs[k:]
                    break
        remap = {0: 0}
        assert len(tree) == 1, "the EAGLE-3 drafter grows the tree first"
        if not greedy:
            tree.q[0] = qs[0]
        for i in order:
            remap[i] = tree.add(remap[parent[i]], token[i], point=greedy)
            if not greedy:
                tree.q[remap[i]] = qs[i]
        self._used_seqs = used
        rep.seconds = time.perf_counter() - t0
        return rep

    def _assign_seqs(self, nodes: list[int], parent: list[int], seq_of: dict[int, int], used: set[int],
                     base_pos: int) -> list[int]:
        """A head seq per node to decode (as ModelDrafter._assign_seqs): the first child of a node
        inherits its parent's seq, the others get a free seq with a copy of the parent's cells."""
        claimed: set[int] = set()
        out: list[int | None] = [None] * len(nodes)
        for j, i in enumerate(nodes):
            s = seq_of[parent[i]]
            if s not in claimed:
                claimed.add(s)
                out[j] = s
        live_parents = {seq_of[parent[i]] for i in nodes}
        free = [s for s in range(self.n_seq) if s not in claimed and s not in live_parents]
        for j, i in enumerate(nodes):
            if out[j] is None:
                if not free:
                    raise ValueError(f"the tree needs more than the head context's {self.n_seq} sequences")
                s = free.pop(0)
                src = seq_of[parent[i]]
                if s in used:  # a dead branch's seq: drop its drafted cells first
                    for node in [n for n, ns in seq_of.items() if ns == s]:
                        del seq_of[node]
                    self.head.seq_rm(s, base_pos + 1, -1)
                    self.head.seq_cp(src, s, base_pos + 1, -1)
                else:
                    self.head.seq_cp(src, s, -1, -1)
                    used.add(s)
                out[j] = s
        for j, i in enumerate(nodes):
            seq_of[i] = out[j]
        return out  # type: ignore[return-value]

    def accept(self, tree: DraftTree, accepted: list[int], tokens: list[int]) -> None:
        """Drop every drafted cell: the accepted positions are written again from the target's
        real features (add_features, then the next propose's catch-up)."""
        if not self._used_seqs:
            return
        self.head.seq_rm(0, self.n_past, -1)
        for s in self._used_seqs:
            if s != 0:
                self.head.seq_rm(s, -1, -1)
        self._used_seqs = set()

    def check_kv(self, tokens: list[int]) -> None:
        """Between steps: seq 0 holds exactly head positions 0..n_past-1, every other seq is
        empty, and the head is never ahead of the target's features (used in tests)."""
        h = self.head
        want = self.n_past - 1
        assert h.pos_max(0) == want, f"head seq 0 ends at {h.pos_max(0)}, expected {want}"
        if self.n_past:
            assert h.pos_min(0) == 0, f"head seq 0 starts at {h.pos_min(0)}"
        for s in range(1, self.n_seq):
            assert h.pos_max(s) == -1, f"head seq {s} not empty (pos_max {h.pos_max(s)})"
        assert self.n_past <= self.n_features <= len(tokens) - 1

    def end(self) -> None:
        self.begin([])
