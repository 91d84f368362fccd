"""The draft-model drafter: grows a token tree level by level, one draft forward per level.

Level 1 decodes the tokens the draft has not seen yet plus the root; every later level decodes
the `expand` frontier nodes of highest cumulative draft probability and gives each its
top-`width` children. A chain is width 1; "chain + runner-ups" is expand 1 with width > 1
(the runner-ups are leaves: no extra draft forward).

Exactness at temperature > 0 constrains how the tree may be shaped: whether a node gets a
candidate child may depend on everything drafted before that candidate, never on the candidate
itself. So at T > 0 children are drawn without replacement (Gumbel-top-k from q) and kept in
draw order, the node budget is spent in that order, and there is no final re-ranking. At T = 0
the verifier only compares with the target's argmax, so the tree is grown EAGLE-2 style and
re-ranked: the `nodes` nodes of highest cumulative draft probability are kept.

Draft KV: the committed context lives in seq 0. A decoded node's cells live in the seq of its
branch: the first expanded child of a node reuses its parent's seq, later ones get a copy.
`accept` copies the deepest accepted decoded node's cells into seq 0 and drops everything else.

Draft window: the draft never absorbs more than `window` tokens at once. When what it lacks is
longer (a long prompt: a RAG context, a document to extract from; or a long plain phase), it
starts over on the context's last `window` tokens, at draft position 0 (`offset` = the context
index of draft position 0). The draft then drafts from a shorter context than the target sees:
acceptance may dip, exactness cannot (the target verifies every token), and a 4000-token prompt
no longer costs the draft a 4000-token prefill.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgespec.drafters.base import DraftBatch, DraftReport, run_alone
from edgespec.drafters.grow import Growth, grow_steps
from edgespec.kv import SeqRange
from edgespec.sampling import SamplingParams
from edgespec.shape import Shape
from edgespec.tree import DraftTree

# a kept draft context is reused while its cells span at most this many draft windows (begin)
REUSE_WINDOWS = 4


@dataclass(frozen=True)
class DraftCache:
    """What a finished request left in the draft's seq 0: the KV of context tokens
    `tokens[offset:]`, at draft positions 0, 1, ... A request whose context starts with the same
    tokens keeps those cells and absorbs only the rest (a shared system prompt, a document asked
    about again, a chat's history including the reply). The draft needs no bit-exactness (the
    target verifies every token), so any shared prefix is reusable, not only whole batches."""

    offset: int
    tokens: tuple[int, ...]

    def reusable(self, prompt: Sequence[int]) -> int:
        """Context tokens of `prompt` whose draft cells may stay (0: none): the prefix it shares
        with `tokens`, short of the prompt's last token (a proposal decodes the root itself), and
        only if that reaches past `offset` (the cells start there)."""
        n = min(len(self.tokens), len(prompt) - 1)
        if n <= self.offset:
            return 0
        a, b = np.asarray(self.tokens[:n]), np.asarray(prompt[:n])
        diff = np.flatnonzero(a != b)
        common = int(diff[0]) if len(diff) else n
        return common if common > self.offset else 0


class ModelDrafter:
    name = "model"
    features = False

    def __init__(self, ctx: SeqRange, window: int | None = None, max_leaves: int | None = None):
        self.ctx = ctx
        self.n_seq = ctx.n_seq_max
        # the tree's leaves each need a sequence of the range; the spine's leaf uses seq 0
        self.max_leaves = max_leaves or ctx.n_seq_max
        self.window = window  # the most context tokens absorbed at once (None: all)
        self.offset = 0  # context index of draft position 0
        self.n_past = 0  # context tokens covered by draft seq 0 (context indices < n_past)
        self._decoded: dict[int, int] = {}  # final tree node -> draft seq holding its cells
        self._used_seqs: set[int] = set()
        self._root_pos = 0

    def begin(self, tokens: list[int], kept: DraftCache | None = None, features_from: int = 0) -> int:
        """Start a request on `tokens`. With `kept` (what an earlier request on this context left in
        seq 0, `DraftCache`), the cells of the prefix the two share stay and only the rest is
        absorbed; returns how many context tokens that saves. Not when the kept cells alone exceed
        REUSE_WINDOWS windows: a draft forward's attention grows with its context, and past that a
        fresh start on the window (its prefill) costs less over a typical answer than the longer
        forwards."""
        common, offset = (kept.reusable(tokens), kept.offset) if kept is not None else (0, 0)
        if common and self.window is not None and common - offset > REUSE_WINDOWS * self.window:
            common = 0
        if common:
            self.ctx.seq_rm(0, common - offset, -1)
            for s in range(1, self.n_seq):  # empty after every step; an assertion that costs nothing
                self.ctx.seq_rm(s, -1, -1)
            self.offset, self.n_past = offset, common
            return common - self.offset
        self.ctx.clear()
        self.n_past = 0
        self.offset = 0
        return 0

    def start_at(self, index: int) -> None:
        """Empty the draft and make context index `index` its position 0 (what a backlog longer
        than the window does in `_catch_up`)."""
        self.ctx.clear()
        self.offset = self.n_past = index

    def keep(self, tokens: list[int]) -> DraftCache | None:
        """What seq 0 holds after the request's last step (context tokens[offset:n_past] at draft
        positions 0...), for the next request on this context; None when it holds nothing."""
        if self._used_seqs or self.n_past <= self.offset:  # mid-step, or empty
            return None
        return DraftCache(self.offset, tuple(tokens[:self.n_past]))

    def backlog(self, tokens: list[int]) -> int:
        """Tokens the next proposal decodes before drafting (the root included)."""
        lack = len(tokens) - self.n_past
        return lack if self.window is None else min(lack, self.window)

    def _catch_up(self, tokens: list[int], end: int, last_logits: bool) -> int:
        """Decode tokens[n_past:end] into seq 0, starting over on the last `window` of them when
        they are more; returns how many were decoded."""
        return run_alone(self._catch_up_steps(tokens, end, last_logits), self.ctx)[0]

    def _catch_up_steps(self, tokens: list[int], end: int, last_logits: bool):
        """The catch-up as a draft batch to decode (see `propose_steps`); returns (tokens decoded,
        the last token's logits or None)."""
        if self.window is not None and end - self.n_past > self.window:
            self.start_at(end - self.window)
        catch = tokens[self.n_past:end]
        if not catch:
            return 0, None
        n = len(catch)
        rows = yield DraftBatch(list(catch), list(range(self.n_past - self.offset, self.n_past - self.offset + n)),
                                [(0,)] * n, [False] * (n - 1) + [last_logits])
        self.n_past = end
        return n, (rows[-1] if last_logits else None)

    def sync(self, tokens: list[int]) -> None:
        """Bring seq 0 up to tokens[:-1] without drafting (used after plain steps before a probe)."""
        self._catch_up(tokens, len(tokens) - 1, last_logits=False)

    def absorb(self, tokens: list[int], budget: int) -> int:
        """Decode up to `budget` more of `tokens` into seq 0 (all of them at most; the window's
        start-over applies); returns how many. For idle time (Engine.idle_work)."""
        return self._catch_up(tokens, min(len(tokens), self.n_past + budget), last_logits=False)

    def absorb_steps(self, tokens: list[int], budget: int):
        """`absorb` as a draft batch for a batched tick (a long catch-up taken in pieces)."""
        n, _ = yield from self._catch_up_steps(tokens, min(len(tokens) - 1, self.n_past + budget), last_logits=False)
        return DraftReport(batches=[n] if n else [])

    def propose(self, tree: DraftTree, tokens: list[int], shape: Shape, sampling: SamplingParams,
                rng: np.random.Generator) -> DraftReport:
        """Grow `tree` alone: `propose_steps` with each draft batch decoded on this drafter's own
        context range."""
        return run_alone(self.propose_steps(tree, tokens, shape, sampling, rng), self.ctx)

    def propose_steps(self, tree: DraftTree, tokens: list[int], shape: Shape, sampling: SamplingParams,
                      rng: np.random.Generator, mask=None, adjust=None):
        """Grow `tree` (rooted at tokens[-1]) level by level, as a generator: it yields one
        `DraftBatch` per draft forward (local seq ids) and is sent back that batch's logits rows
        ([marked entries, vocab], batch order). A batched tick drives the generators of all
        speculating sessions together, one draft forward per level for all of them; returns the
        DraftReport. `mask(path)` (structured output): the tokens allowed after the drafted `path`
        below the root; children are then drawn from the draft's distribution masked alike."""
        t0 = time.perf_counter()
        rep = DraftReport()
        ctx = self.ctx
        depth = min(shape.depth, ctx.n_ctx - (len(tokens) - 1 - self.offset) - 2)
        if depth <= 0 or shape.nodes <= 0:
            return rep
        n, root_logits = yield from self._catch_up_steps(tokens, len(tokens), last_logits=True)
        rep.batches.append(n)
        root_pos = len(tokens) - 1 - self.offset  # the root's draft position
        self._root_pos = root_pos
        g = Growth(tokens[-1], root_logits, shape, sampling, rng, ctx, self.n_seq, root_pos, mask, adjust)

        def batch_of(nodes: list[int], seqs: list[int]) -> DraftBatch:
            return DraftBatch([g.token[i] for i in nodes], [root_pos + g.dep[i] for i in nodes],
                              [(s,) for s in seqs], [True] * len(nodes))

        def store(nodes: list[int], rows: np.ndarray) -> None:
            g.logits.update(zip(nodes, rows))

        yield from grow_steps(g, depth, rep, batch_of, store)
        remap = g.build(tree, self.max_leaves, rep)
        self._decoded = {remap[i]: s for i, s in g.seq_of.items() if i in remap}
        self._used_seqs = g.used
        rep.seconds = time.perf_counter() - t0
        return rep

    def accept(self, tree: DraftTree, accepted: list[int], tokens: list[int]) -> None:
        ctx = self.ctx
        root_pos = self._root_pos
        if not self._used_seqs:  # nothing drafted this step
            return
        keep_end = root_pos + 1  # the root is in seq 0
        src = 0
        for node in accepted:  # the deepest accepted node still holding its cells (and its ancestors')
            s = self._decoded.get(node)
            if s is not None:
                src, keep_end = s, root_pos + tree.depths[node] + 1
        ctx.commit_branch(src, root_pos + 1, keep_end, self._used_seqs)
        self.n_past = keep_end + self.offset
        self._decoded = {}
        self._used_seqs = set()

    def add_features(self, features: np.ndarray) -> None:
        pass

    def check_kv(self, tokens: list[int]) -> None:
        """Between steps: seq 0 ends at the last context token absorbed, the others are empty."""
        d = self.ctx
        want = self.n_past - 1 - self.offset
        assert d.pos_max(0) == want, f"draft seq 0 ends at {d.pos_max(0)}, expected {want}"
        assert self.n_past <= len(tokens) - 1
        for s in range(1, d.n_seq_max):
            assert d.pos_max(s) == -1, f"draft seq {s} still holds cells"

    def end(self) -> None:
        self.ctx.clear()
        self.n_past = 0
        self.offset = 0
