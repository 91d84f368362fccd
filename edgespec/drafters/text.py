"""The text drafter: a draft model with another tokenizer drafts through text (universal
assisted decoding, as llama-server does for such pairs).

    the target's context  --target pieces-->  text  --draft tokenizer-->  the draft's context
    the draft's greedy chain  --draft pieces-->  text  --target tokenizer-->  target ids, proposed

The draft reads the target's context as text, re-tokenized with its own tokenizer; it extends
that text greedily, one draft forward per level; the continuation is re-tokenized with the
target's tokenizer and grafted as a chain of point drafts (q = one-hot, drafts/tree.py). The
target verifies every token as it does a prompt lookup's, so the output is the target's exactly,
greedy or sampled: the draft's distributions never reach the verifier.

Two boundaries need care:
- the draft's side is kept incremental (`DraftView`): only the last `TAIL` draft tokens are
  re-tokenized when the target's context grows, so a step costs the same at any context length;
- the target's side (`target_continuation`): the draft's text is tokenized behind the context's
  last few tokens, and the proposal starts where that tokenization reaches the context's end.
  A token that straddles the end (the context's "\\n" that the draft's "\\nThe" turns into
  "\\n\\n") is dropped; its part past the end is tokenized alone in its place. Every proposal
  spells a prefix of the draft's text behind the context, byte for byte.
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from edgespec.drafters.base import DraftBatch, DraftReport
from edgespec.sampling import SamplingParams
from edgespec.shape import Shape
from edgespec.tree import DraftTree

TAIL = 8  # draft tokens re-tokenized when the context grows (the rest of its tokenization stays)
CONTEXT_TAIL = 4  # target tokens the draft's text is tokenized behind (to find the boundary)


class Vocab(Protocol):
    """The vocabulary facts text drafting reads (backend.Model has them)."""

    add_bos: bool
    bos: int

    def piece(self, token: int) -> bytes: ...

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...

    def is_eog(self, token: int) -> bool: ...


def complete_utf8(data: bytes) -> int:
    """Bytes of `data` up to its last complete UTF-8 character: a trailing incomplete one (a
    byte-fallback token's first byte) is held back until the rest arrives."""
    n = len(data)
    for k in range(1, min(4, n) + 1):
        b = data[n - k]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back for its lead
            continue
        need = 1 if b < 0x80 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4
        return n if k >= need or b < 0x80 else n - k
    return n


def spell(vocab: Vocab, ids: list[int]) -> bytes:
    return b"".join(vocab.piece(t) for t in ids)


def _tokenize(vocab: Vocab, data: bytes) -> list[int]:
    return vocab.tokenize(data.decode("utf-8", errors="replace"), add_special=False, parse_special=False)


class DraftView:
    """The target's context as the draft reads it: `text` (the target's pieces, special tokens
    rendered empty) and `ids`, the draft's tokenization of its first `covered` bytes (`starts`:
    each draft token's offset in `text`). Pure: no llama.cpp, no KV."""

    def __init__(self, target: Vocab, draft: Vocab, tail: int = TAIL):
        self.target, self.draft, self.tail = target, draft, tail
        self.text = bytearray()
        self.n_target = 0  # target tokens rendered into `text`
        self.ids: list[int] = [draft.bos] if draft.add_bos else []
        self.starts: list[int] = [0] * len(self.ids)
        self.fixed = len(self.ids)  # ids before this index are never re-tokenized
        self.covered = 0

    def update(self, tokens: list[int]) -> int:
        """Bring in the target's `tokens[n_target:]` and re-tokenize the last `tail` draft tokens
        with the new text; returns the first index of `ids` that changed (len(ids): none)."""
        for t in tokens[self.n_target:]:
            self.text += self.target.piece(t)
        self.n_target = len(tokens)
        end = complete_utf8(bytes(self.text[self.covered:])) + self.covered
        if end == self.covered:
            return len(self.ids)
        j = max(self.fixed, len(self.ids) - self.tail)
        start = self.starts[j] if j < len(self.ids) else self.covered
        new = _tokenize(self.draft, bytes(self.text[start:end]))
        starts, at = [], start
        for t in new:
            starts.append(at)
            at += len(self.draft.piece(t))
        old = self.ids[j:]
        same = next((k for k, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        self.ids[j:], self.starts[j:] = new, starts
        self.covered = end
        if at != end:  # the draft's pieces do not spell the text (normalisation): never re-cut them
            self.fixed = len(self.ids)
        return j + same

    @property
    def complete(self) -> bool:
        """Whether `ids` spell the whole context (no character pending)."""
        return self.covered == len(self.text)


def target_continuation(target: Vocab, context: list[int], text: bytes) -> list[int]:
    """Target ids that continue `context` with a prefix of `text` (the draft's continuation):
    `text` tokenized behind the context's last CONTEXT_TAIL tokens, from the token that starts
    where the context ends. A token straddling that end is replaced by its part past the end,
    tokenized alone. Stops before the first id whose piece leaves `text`."""
    text = text[:complete_utf8(text)]
    if not text:
        return []
    tail = spell(target, context[-CONTEXT_TAIL:])
    while tail and tail[0] & 0xC0 == 0x80:  # starts inside a character: drop its remainder
        tail = tail[1:]
    if complete_utf8(tail) != len(tail):
        return []  # the context ends inside a character: the draft's text does not follow it
    ids = _tokenize(target, tail + text)
    at, i = 0, 0
    while i < len(ids) and at < len(tail):
        at += len(target.piece(ids[i]))
        i += 1
    out: list[int] = []
    if at > len(tail):  # ids[i - 1] straddles the context's end
        gap = (tail + text)[len(tail):at]
        if complete_utf8(gap) != len(gap) or (gap[0] & 0xC0) == 0x80:
            return []
        out = _tokenize(target, gap)
        if spell(target, out) != gap:
            return []
    out += ids[i:]
    kept, at = [], 0
    for t in out:  # every proposal spells a prefix of the draft's text
        p = target.piece(t)
        if not p or text[at:at + len(p)] != p:
            break
        kept.append(t)
        at += len(p)
    return kept


class TextDrafter:
    """A draft model with another tokenizer, drafting a chain through text (module docstring).
    One request on one slot's range of the shared draft context: seq 0 holds the draft's
    tokenization of the context (`view.ids[offset:offset + n_kv]` at draft positions 0...)."""

    name = "text"
    features = False

    def __init__(self, ctx, window: int | None = None, max_leaves: int | None = None, *,
                 target: Vocab, draft: Vocab):
        self.ctx = ctx
        self.window = window
        self.target, self.draft = target, draft
        self.view = DraftView(target, draft)
        self.offset = 0  # index in view.ids of draft position 0
        self.n_kv = 0  # view.ids[offset:offset + n_kv] are in seq 0

    def begin(self, tokens: list[int], kept=None, features_from: int = 0) -> int:
        self.ctx.clear()
        self.view = DraftView(self.target, self.draft)
        self.offset = self.n_kv = 0
        return 0

    def keep(self, tokens: list[int]) -> None:
        return None

    def backlog(self, tokens: list[int]) -> int:
        """Target tokens the draft has not read (a proxy for the draft tokens its next catch-up decodes)."""
        lack = len(tokens) - self.view.n_target + max(0, len(self.view.ids) - self.offset - self.n_kv)
        return lack if self.window is None else min(lack, self.window)

    def _sync(self, tokens: list[int], room: int) -> int:
        """Update the view and drop the cells its re-tokenization changed; start over on the last
        `window` draft tokens when more are missing, or on the last half of the range when it
        would overflow (the draft's tokens may outnumber the target's). Returns how many of
        view.ids remain to decode."""
        changed = self.view.update(tokens)
        ids = self.view.ids
        keep = min(self.n_kv, max(0, changed - self.offset))
        lack = len(ids) - self.offset - keep
        over = len(ids) - self.offset + room > self.ctx.n_ctx
        if (self.window is not None and lack > self.window) or over:
            span = self.window if self.window is not None else len(ids)
            if over:  # half the range: room to grow before the next start-over
                span = min(span, max(1, (self.ctx.n_ctx - room) // 2))
            self.offset = max(0, len(ids) - span)
            keep = 0
            self.ctx.seq_rm(0, -1, -1)
        elif keep < self.n_kv:
            self.ctx.seq_rm(0, keep, -1)
        self.n_kv = keep
        return len(ids) - self.offset - keep

    def _catch_up(self, upto: int, last_logits: bool):
        """Decode view.ids[offset + n_kv : offset + upto] into seq 0 (a generator: one batch)."""
        ids = self.view.ids[self.offset + self.n_kv:self.offset + upto]
        if not ids:
            return None
        n = len(ids)
        rows = yield DraftBatch(list(ids), list(range(self.n_kv, self.n_kv + n)), [(0,)] * n,
                                [False] * (n - 1) + [last_logits])
        self.n_kv += n
        return rows[-1] if last_logits else None

    def absorb_steps(self, tokens: list[int], budget: int):
        lack = self._sync(tokens, 0)
        n = min(lack, budget)
        yield from self._catch_up(self.n_kv + n, last_logits=False) if n else iter(())
        return DraftReport(batches=[n] if n else [])

    def propose_steps(self, tree: DraftTree, tokens: list[int], shape: Shape, sampling: SamplingParams,
                      rng: np.random.Generator, mask=None, adjust=None):
        """Grow a chain under the root (tokens[-1]): the draft's greedy continuation of the
        context's text, `shape.depth` draft forwards at most, as target ids (point drafts). The
        draft's own cells of the chain are removed before it returns: seq 0 keeps the context."""
        t0 = time.perf_counter()
        rep = DraftReport()
        depth = min(shape.depth, shape.nodes)
        if depth <= 0:
            return rep
        lack = self._sync(tokens, depth + 2)
        if not self.view.complete or len(self.view.ids) <= self.offset:
            return rep
        if lack == 0:  # every id is in the cache: decode the last again for its row
            self.n_kv -= 1
            self.ctx.seq_rm(0, self.n_kv, -1)
        base = self.n_kv + lack  # draft positions the context fills
        row = yield from self._catch_up(base, last_logits=True)
        rep.batches.append(lack or 1)
        chain: list[int] = []
        while True:
            t = int(np.argmax(row))
            if self.draft.is_eog(t):
                break
            chain.append(t)
            if len(chain) >= depth:
                break
            rows = yield DraftBatch([t], [base + len(chain) - 1], [(0,)], [True])
            rep.batches.append(1)
            row = rows[-1]
        self.ctx.seq_rm(0, base, -1)  # the chain's own cells: the next step reads its text afresh
        proposal = target_continuation(self.target, tokens, spell(self.draft, chain))[:depth]
        node = 0
        for t in proposal:
            node = tree.add(node, t, point=True)
        rep.levels = len(proposal)
        rep.seconds = time.perf_counter() - t0
        return rep

    def accept(self, tree: DraftTree, accepted: list[int], tokens: list[int]) -> None:
        pass  # the chain's cells went when it was drafted; the next step reads `tokens` as text

    def add_features(self, features: np.ndarray) -> None:
        pass

    def check_kv(self, tokens: list[int]) -> None:
        """Between steps: seq 0 ends at the last draft token absorbed, the others are empty."""
        d = self.ctx
        assert d.pos_max(0) == self.n_kv - 1, f"draft seq 0 ends at {d.pos_max(0)}, expected {self.n_kv - 1}"
        for s in range(1, d.n_seq_max):
            assert d.pos_max(s) == -1, f"draft seq {s} still holds cells"

    def end(self) -> None:
        self.ctx.clear()
        self.view = DraftView(self.target, self.draft)
        self.offset = self.n_kv = 0
