"""A slot's share of a shared KV cache: a range of llama.cpp sequence ids.

All slots decode through ONE target context and ONE draft context (`kv_unified`), so that a tick
can verify every session's tree in one forward. Slot i owns the sequence ids
[base, base + n_seq): `base` is its main sequence (prompt + emitted tokens, the root excluded),
the others hold its tree's branches during a step and are empty between steps.

`SeqRange` speaks local ids (0 = main) and offers what a single context offered before (seq_rm,
seq_cp, pos_max, decode ...), so a drafter or a test written against one context works on a
range unchanged; `clear()` empties only this range. `to_global` maps ids for the batched
forwards, which the tick assembles across ranges itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class SeqRange:
    def __init__(self, ctx, base: int, n_seq: int, n_ctx: int):
        self.ctx = ctx  # backend.Context (or a test double with the same methods)
        self.base = base
        self.n_seq_max = n_seq
        self.n_ctx = n_ctx  # the most positions one request may use (the context holds more cells)
        self.n_batch = ctx.n_batch
        self.n_vocab = ctx.n_vocab

    def to_global(self, seqs: Sequence[int]) -> list[int]:
        b = self.base
        return [b + s for s in seqs]

    # -- KV cache ------------------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        self.ctx.seq_rm(self.base + seq if seq >= 0 else self._all(), p0, p1)

    def _all(self) -> int:
        raise ValueError("seq -1 (every sequence) would reach other slots' ranges; use clear()")

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.ctx.seq_cp(self.base + src, self.base + dst, p0, p1)

    def commit_branch(self, src: int, start: int, end: int, branches) -> None:
        """After a verification: the main sequence keeps its cells before `start`, then positions
        [start, end) of branch `src` (the accepted path; 0: the main sequence's own), nothing
        beyond; every other sequence in `branches` is emptied (the rejected cells are gone)."""
        if src != 0:
            self.seq_rm(0, start, -1)
            self.seq_cp(src, 0, start, end)
        else:
            self.seq_rm(0, end, -1)
        for s in branches:
            if s != 0:
                self.seq_rm(s, -1, -1)

    def pos_max(self, seq: int) -> int:
        return self.ctx.pos_max(self.base + seq)

    def seq_state(self, seq: int = 0) -> bytes:
        return self.ctx.seq_state(self.base + seq)

    def load_seq_state(self, data: bytes, seq: int = 0) -> None:
        self.ctx.load_seq_state(self.base + seq, data)

    def pos_min(self, seq: int) -> int:
        return self.ctx.pos_min(self.base + seq)

    def clear(self) -> None:
        """Empty every sequence of this range (the other slots' cells stay)."""
        for s in range(self.n_seq_max):
            self.ctx.seq_rm(self.base + s, -1, -1)

    def cells(self) -> int:
        """Positions held by the main sequence (what this slot keeps in the shared cache)."""
        return self.pos_max(0) + 1

    # -- decoding (one range alone: tests, calibration, idle work) ------------------------------
    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
               logits: Sequence[bool]) -> None:
        b = self.base
        self.ctx.decode(tokens, positions, [[b + s for s in ss] for ss in seq_ids], logits)

    def decode_rows(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
                    logits: Sequence[bool]) -> np.ndarray:
        b = self.base
        return self.ctx.decode_rows(tokens, positions, [[b + s for s in ss] for ss in seq_ids], logits)

    def decode_seq(self, tokens: Sequence[int], start_pos: int, seq_ids: Sequence[int] = (0,),
                   last_logits: bool = True) -> None:
        self.ctx.decode_seq(tokens, start_pos, self.to_global(seq_ids), last_logits)

    def logits(self, i: int) -> np.ndarray:
        return self.ctx.logits(i)

    def logits_rows(self, n_rows: int) -> np.ndarray:
        return self.ctx.logits_rows(n_rows)

    @property
    def decode_seconds(self) -> float:
        return self.ctx.decode_seconds
