"""The EAGLE-3 drafter: a one-layer head over the target's own features drafts the tree.

Head position P holds the pair (token[P+1], g[P]) (llama.cpp's convention), so the head is one
token behind the target: with context tokens[0..L-1] (root = tokens[L-1]), seq 0 holds head
positions 0..L-2, each with g = fc(the target's features at P), and the output at L-2 gives the
root's children. A drafted node at depth d sits at head position L-2+d with the node's token
and, for g, its parent's pre-norm output (the head's guess of the target's features there).

Per step, in this order (the engine's tick drives it through `propose_steps`, a generator
yielding one head batch per level, as every drafter does: drafters/base.py):
  propose_steps(tree, tokens, ...)  its first batch writes the positions whose features arrived
                              since (the catch-up), then it grows the tree level by level (one
                              head forward per level: drafters/grow.py);
  accept(tree, accepted, tokens)  drops every drafted cell (they were computed from guessed g);
  add_features(features)      the target's features of the rows it just decoded whose context
                              indices come next: after a prefill chunk, its rows; after a
                              verification, the root's row and each accepted node's, in path order.

The tree grows by the same rules as ModelDrafter's (drafters/grow.py): at T = 0 greedy top-k
children, EAGLE-2 re-ranking by cumulative draft probability; at T > 0 children drawn without
replacement from the head's distribution (Gumbel-top-k), in draw order, no re-ranking
(exactness needs shapes that never depend on a candidate's own value). A drafted node's g is its
parent's pre-norm output.

The head reads the whole context: there is no draft window (the target's features of tokens
the head skipped cannot be had again without a target forward). With the prompt cache a finished
request leaves what the head has of its context (`keep`, a `HeadCache`): the positions in seq 0
and the encoded features of those it has not absorbed yet (a request that decoded plainly
absorbed none). The next request on the slot keeps both as far as its tokens agree (`reusable`:
index P needs tokens 0..P+1 alike), and the engine keeps no more of the target's prefill than
that, since the target's features of a kept prefill are not computed again; the features of the
indices between the target's kept prefix and the head's arrive with the prefill and are dropped
(`begin(..., features_from)`).

KV: seq 0 = committed head positions 0..n_past-1; a decoded node's cells live in its branch's
seq (the first expanded child of a node inherits its parent's seq, later ones get a copy); after
`accept` every seq but 0 is empty and seq 0 ends at n_past-1 (`check_kv`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgespec.drafters.base import DraftBatch, DraftReport, run_alone
from edgespec.drafters.grow import Growth, grow_steps
from edgespec.sampling import SamplingParams
from edgespec.shape import Shape
from edgespec.tree import DraftTree


@dataclass(frozen=True)
class HeadCache:
    """What a finished request left of its context in the head: positions 0..n_past-1 in seq 0
    and `g`, the encoded target features of context indices n_past.. it had not absorbed.
    `tokens`: the context tokens they were made from (index P also read tokens[P + 1])."""

    tokens: tuple[int, ...]
    n_past: int
    g: np.ndarray | None  # [indices n_past.., head n_embd]

    @property
    def n_features(self) -> int:
        return self.n_past + (len(self.g) if self.g is not None else 0)

    def reusable(self, prompt: Sequence[int]) -> int:
        """Context indices of `prompt` whose head position or features stay: index P needs
        tokens 0..P+1 alike. The root's parent (index len(prompt) - 2) is decoded again (its
        output gives the root's children): from its kept features if the head had not absorbed
        it, else from the target's."""
        n = min(len(self.tokens), len(prompt))
        if n <= 1:
            return 0
        a, b = np.asarray(self.tokens[:n]), np.asarray(prompt[:n])
        diff = np.flatnonzero(a != b)
        common = int(diff[0]) if len(diff) else n
        keep = min(common - 1, self.n_features)
        if keep >= len(prompt) - 1 and self.n_past > len(prompt) - 2:
            keep = len(prompt) - 2
        return max(0, keep)


class Eagle3Drafter:
    name = "eagle3"
    features = True

    def __init__(self, ctx, window: int | None = None, max_leaves: int | None = None):
        """`ctx`: a backend.HeadContext, or a slot's range (kv.SeqRange) of a shared one.
        `window` is accepted for symmetry with ModelDrafter and ignored (see above)."""
        self.ctx = ctx
        self.head = getattr(ctx, "ctx", ctx)  # the HeadContext itself (encode)
        self.n_seq = ctx.n_seq_max
        self.max_leaves = max_leaves or ctx.n_seq_max
        self.n_past = 0  # head positions committed in seq 0
        self._g: list[np.ndarray] = []  # g rows for head positions n_past, n_past + 1, ...
        # the target's features of the context indices after those, not encoded yet: a request
        # whose steps graft other sources' drafts may not draft with the head for many steps, and
        # one encode when the head next reads them costs one head call instead of one per step
        self._raw: list[np.ndarray] = []
        self._root: tuple[int, np.ndarray, np.ndarray] | None = None  # (position, logits, hidden) of the last committed position
        self._used_seqs: set[int] = set()
        self._skip = 0  # feature rows still to drop: positions the head kept beyond the target's kept prefix
        self._blind = False  # the target kept more of this request's prompt than the head: no features (begin)

    @property
    def n_features(self) -> int:
        """Context indices whose target features the head has (n_past + pending)."""
        return self.n_past + sum(len(g) for g in self._g) + sum(len(f) for f in self._raw)

    def begin(self, tokens: list[int], kept: HeadCache | None = None, features_from: int = 0) -> int:
        """Start on context `tokens`, keeping what `kept` has of it (`reusable`): its positions
        and its encoded features; the target's features come from context index `features_from`
        on. Returns the indices kept."""
        keep = reusable(kept, tokens)
        self._root = None
        self._used_seqs = set()
        # a request that never drafts (plain) may keep more of the target's prefill than the head
        # has: then the head cannot catch up on this context and takes no features at all
        self._blind = features_from > keep
        if self._blind:
            keep = 0
        self._skip = max(0, keep - features_from)
        self.n_past = min(keep, kept.n_past) if kept is not None else 0
        rows = keep - self.n_past
        self._g = [kept.g[:rows]] if kept is not None and kept.g is not None and rows > 0 else []
        self._raw = []
        if self.n_past:
            self.ctx.seq_rm(0, self.n_past, -1)
            for s in range(1, self.n_seq):  # empty after every step; an assertion that costs nothing
                self.ctx.seq_rm(s, -1, -1)
        else:
            self.ctx.clear()
        return keep

    def backlog(self, tokens: list[int]) -> int:
        return max(0, len(tokens) - 1 - self.n_past)

    def keep(self, tokens: list[int]) -> HeadCache | None:
        """What the head has of the context after the request's last step: its positions and
        the features it has not absorbed (None: nothing, mid-step, or blind)."""
        if self._used_seqs or self.n_features <= 0 or self._blind:
            return None
        self._encode()
        g = np.concatenate(self._g) if self._g else None
        return HeadCache(tuple(tokens[:self.n_features + 1]), self.n_past, g)

    def add_features(self, features: np.ndarray) -> None:
        """[n, 3 * target n_embd] target features of the next n context indices (rows of the
        target forward that decoded them: FeatureContext.features(rows) / collected()); the
        first rows of a prefill that starts before the head's kept positions are dropped."""
        if self._blind:
            return
        if self._skip:
            drop = min(self._skip, len(features))
            features, self._skip = features[drop:], self._skip - drop
        if len(features):
            self._raw.append(features)

    def _encode(self) -> None:
        """Encode the pending features (the head's fc), in one call."""
        if self._raw:
            raw = self._raw[0] if len(self._raw) == 1 else np.concatenate(self._raw)
            self._raw = []
            self._g.append(self.head.encode(raw))

    def _catch_up_steps(self, tokens: list[int], end: int):
        """Write head positions n_past..end-1 (token[P+1], g[P]) into seq 0, as one draft batch;
        returns how many."""
        if end <= self.n_past:
            return 0
        self._encode()
        g = self._g[0] if len(self._g) == 1 else np.concatenate(self._g)
        n, p0 = end - self.n_past, self.n_past
        rows = yield DraftBatch(list(tokens[p0 + 1:p0 + 1 + n]), list(range(p0, p0 + n)), [(0,)] * n,
                                [False] * (n - 1) + [True], embd=g[:n])
        self._g = [g[n:]] if len(g) > n else []
        self.n_past = end
        self._root = (end - 1, rows.logits[-1], rows.hidden[-1])
        return n

    def absorb_steps(self, tokens: list[int], budget: int):
        """The catch-up alone, at most `budget` positions (a plain step of a batched tick)."""
        n = yield from self._catch_up_steps(tokens, min(len(tokens) - 1, self.n_past + budget))
        return DraftReport(batches=[n] if n else [])

    def propose(self, tree: DraftTree, tokens: list[int], shape: Shape, sampling: SamplingParams,
                rng: np.random.Generator) -> DraftReport:
        """`propose_steps` with each head batch decoded on this drafter's own HeadContext."""
        return run_alone(self.propose_steps(tree, tokens, shape, sampling, rng), self.ctx)

    def propose_steps(self, tree: DraftTree, tokens: list[int], shape: Shape, sampling: SamplingParams,
                      rng: np.random.Generator, mask=None, adjust=None):
        """Grow `tree` (rooted at tokens[-1]) level by level, as a generator (drafters/base.py):
        the first batch carries the catch-up; rows come back as backend.HeadRows."""
        L = len(tokens)
        if self.n_features != L - 1:
            raise ValueError(f"the head has target features for {self.n_features} context tokens, needs "
                             f"{L - 1} (all but the root): add_features after every target forward")
        t0 = time.perf_counter()
        rep = DraftReport()
        rep.batches.append((yield from self._catch_up_steps(tokens, L - 1)))
        depth = min(shape.depth, self.ctx.n_ctx - L)
        if depth <= 0 or shape.nodes <= 0 or L < 2 or self._root is None or self._root[0] != L - 2:
            return rep
        base_pos = L - 2  # head position of the root's output; a node at depth d sits at base_pos + d
        g = Growth(tokens[-1], self._root[1], shape, sampling, rng, self.ctx, self.n_seq, base_pos, mask, adjust)
        g.hidden[0] = self._root[2]

        def batch_of(nodes: list[int], seqs: list[int]) -> DraftBatch:
            return DraftBatch([g.token[i] for i in nodes], [base_pos + g.dep[i] for i in nodes],
                              [(s,) for s in seqs], [True] * len(nodes),
                              embd=np.stack([g.hidden[g.parent[i]] for i in nodes]))

        def store(nodes: list[int], rows) -> None:
            g.logits.update(zip(nodes, rows.logits))
            g.hidden.update(zip(nodes, rows.hidden))

        yield from grow_steps(g, depth, rep, batch_of, store)
        g.build(tree, self.max_leaves, rep)
        self._used_seqs = g.used
        rep.seconds = time.perf_counter() - t0
        return rep

    def accept(self, tree: DraftTree, accepted: list[int], tokens: list[int]) -> None:
        """Drop every drafted cell: the accepted positions are written again from the target's
        real features (add_features, then the next proposal's catch-up)."""
        if not self._used_seqs:
            return
        self.ctx.seq_rm(0, self.n_past, -1)
        for s in self._used_seqs:
            if s != 0:
                self.ctx.seq_rm(s, -1, -1)
        self._used_seqs = set()

    def check_kv(self, tokens: list[int]) -> None:
        """Between steps: seq 0 holds exactly head positions 0..n_past-1, every other seq is
        empty, and the head is never ahead of the target's features (used in tests)."""
        h = self.ctx
        want = self.n_past - 1
        assert h.pos_max(0) == want, f"head seq 0 ends at {h.pos_max(0)}, expected {want}"
        if self.n_past:
            assert h.pos_min(0) == 0, f"head seq 0 starts at {h.pos_min(0)}"
        for s in range(1, self.n_seq):
            assert h.pos_max(s) == -1, f"head seq {s} not empty (pos_max {h.pos_max(s)})"
        assert self.n_past <= self.n_features <= len(tokens) - 1

    def end(self) -> None:
        self.begin([])


def reusable(kept: HeadCache | None, tokens: Sequence[int]) -> int:
    """Context indices whose head position or features a request on `tokens` may keep from
    `kept` (HeadCache.reusable; 0 without one)."""
    return kept.reusable(tokens) if kept is not None else 0
