"""A static n-gram table of what the TARGET itself says: a zero-cost drafter for text that does not
copy from its prompt (llama.cpp's `lookup` static cache; REST's datastore, in miniature).

Built offline from the target's own greedy answers to synthetic prompts (`edgespec models
ngram-table`, see edgespec/tablegen.py): for each context of the last n tokens (n = N_MAX down to
N_MIN) the table keeps the token that followed it most often, if it followed at least `min_count`
times and in at least `min_share` of the occurrences. A proposal chains predictions: the longest
known context decides each next token; a context that is known but not decisive ends the chain.

Proposals are point masses like prompt lookups, so grafting them is exact under both verifiers;
the engine sizes each graft by the table's measured reach (shadow-scored like prompt lookups).
Measured on the bench suites' target generations (never in the table's training prompts): where
prompt lookup finds nothing (59 % of positions) the table proposes at 26 % of them, first token
right 47 % of the time.

File: an .npz with `ctx` [M, N_MAX] int32 (right-aligned, -1 padded), `tok` [M] int32, `n_vocab`,
`model` (the target's description it was learnt from, checked at load).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from edgespec.errors import ModelError

N_MAX = 3
N_MIN = 2
FORMAT = 1


class NgramTable:
    def __init__(self, table: dict[tuple[int, ...], int], n_vocab: int, model: str = ""):
        self.table = table
        self.n_vocab = n_vocab
        self.model = model

    def __len__(self) -> int:
        return len(self.table)

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], n_vocab: int, model: str = "", *,
              min_count: int = 2, min_share: float = 0.5) -> NgramTable:
        counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        for seq in sequences:
            s = list(seq)
            for i in range(N_MIN, len(s)):
                for n in range(N_MIN, min(N_MAX, i) + 1):
                    counts[tuple(s[i - n:i])][s[i]] += 1
        table: dict[tuple[int, ...], int] = {}
        for ctx, c in counts.items():
            tok, k = c.most_common(1)[0]
            # a context seen but not decisive is kept as -1: it stops the chain instead of
            # falling back to a shorter, less informed context
            table[ctx] = tok if k >= min_count and k >= min_share * sum(c.values()) else -1
        return cls(table, n_vocab, model)

    def predict(self, tokens: Sequence[int], max_len: int) -> list[int]:
        """Up to `max_len` tokens continuing `tokens` ([] if the table does not know)."""
        ctx = list(tokens[-N_MAX:])
        out: list[int] = []
        get = self.table.get
        while len(out) < max_len:
            nxt = None
            for n in range(min(N_MAX, len(ctx)), N_MIN - 1, -1):
                nxt = get(tuple(ctx[-n:]))
                if nxt is not None:
                    break
            if nxt is None or nxt < 0:
                break
            out.append(nxt)
            ctx.append(nxt)
        return out

    # -- file ---------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        keys = list(self.table)
        ctx = np.full((len(keys), N_MAX), -1, np.int32)
        for i, k in enumerate(keys):
            ctx[i, N_MAX - len(k):] = k
        tok = np.array([self.table[k] for k in keys], np.int32)
        tmp = path.with_name(path.name + ".part.npz")
        np.savez_compressed(tmp, ctx=ctx, tok=tok, n_vocab=np.int64(self.n_vocab), model=np.str_(self.model),
                            format=np.int64(FORMAT))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, n_vocab: int | None = None) -> NgramTable:
        try:
            with np.load(path, allow_pickle=False) as z:
                if int(z["format"]) != FORMAT:
                    raise ModelError(f"n-gram table {path}: format {int(z['format'])}, expected {FORMAT}")
                ctx, tok, nv, model = z["ctx"], z["tok"], int(z["n_vocab"]), str(z["model"])
        except (OSError, KeyError, ValueError) as e:
            raise ModelError(f"n-gram table {path} is not readable: {e}") from e
        if n_vocab is not None and nv != n_vocab:
            raise ModelError(f"n-gram table {path} was learnt for a {nv}-token vocabulary, the target has {n_vocab}")
        if ctx.ndim != 2 or ctx.shape[1] != N_MAX or len(tok) != len(ctx) or (tok >= nv).any() or (ctx >= nv).any():
            raise ModelError(f"n-gram table {path} is corrupt (shape or token ids out of range)")
        table = {tuple(int(t) for t in row if t >= 0): int(t) for row, t in zip(ctx.tolist(), tok.tolist())}
        return cls(table, nv, model)
