"""logit_bias and the presence / frequency penalties, per tree node (pure numpy).

OpenAI's definition: before sampling, logit[j] += logit_bias[j] - frequency_penalty * c[j]
- presence_penalty * (c[j] > 0), with c[j] the times token j appears in the output so far (the
prompt does not count, as in OpenAI's and vLLM's API). Under speculation "so far" differs per
node: the row of tree node i gives the next token after node i's path, so its counts are the
request's output plus the tokens on the path from the root (exclusive: it is already emitted or
the prompt's last token) down to node i. With every row adjusted by its own path, the verifier
samples each node from the distribution plain decoding would have used there, and the output
distribution stays exactly plain decoding's (greedy: the same tokens). The draft's proposals
need not be adjusted: the verifier accepts a proposal by the adjusted target over the q it was
drawn from, which is exact for any q.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from edgespec.sampling import SamplingParams
from edgespec.tree import DraftTree


def adjusts(s: SamplingParams) -> bool:
    """Does `s` change the target's logits at all?"""
    return bool(s.logit_bias) or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0


def _penalty(s: SamplingParams, count: int) -> float:
    return s.frequency_penalty * count + (s.presence_penalty if count > 0 else 0.0)


class Adjuster:
    """One request's adjustment: its bias, and the penalties of its output. Every adjusted logit
    is rows[i, j] + a float32 value that depends only on (j, its count), computed one way for
    plain decoding's row and a tree node's alike, so greedy speculation picks the same tokens bit
    for bit."""

    def __init__(self, s: SamplingParams, n_vocab: int):
        self.s = s
        self.n_vocab = n_vocab
        self._bias = dict(s.logit_bias)
        self.penalised = s.presence_penalty != 0.0 or s.frequency_penalty != 0.0

    def _adj(self, tok: int, count: int) -> np.float32:
        return np.float32(self._bias.get(tok, 0.0) - _penalty(self.s, count))

    def base(self, output: Sequence[int]) -> tuple[np.ndarray, Counter]:
        """[n_vocab] what every row of a step adds for the output so far (bias included), and
        the output's counts."""
        counts: Counter = Counter(output) if self.penalised else Counter()
        row = np.zeros(self.n_vocab, dtype=np.float32)
        for tok, b in self._bias.items():
            row[tok] = np.float32(b)
        for tok, c in counts.items():
            row[tok] = self._adj(tok, c)
        return row, counts

    def rows(self, rows: np.ndarray, tree: DraftTree, output: Sequence[int]) -> np.ndarray:
        """[n_nodes, n_vocab] the target's rows (node order) as plain decoding would sample from
        them at each node: bias, and penalties over the output plus the node's path (a copy)."""
        rows = np.asarray(rows, dtype=np.float32)
        base, counts = self.base(output)
        out = rows + base
        if not self.penalised or len(tree) == 1:
            return out
        path: list[dict[int, int]] = [{}] * len(tree)  # node -> its path's counts (root excluded)
        for i in range(1, len(tree)):  # a child always comes after its parent
            d = dict(path[tree.parents[i]])
            t = tree.tokens[i]
            d[t] = d.get(t, 0) + 1
            path[i] = d
            for tok, c in d.items():
                out[i, tok] = rows[i, tok] + self._adj(tok, counts[tok] + c)
        return out
