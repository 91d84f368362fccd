"""logit_bias and the presence / frequency / repetition penalties, per tree node (pure numpy).

Before sampling, the repetition penalty r (CTRL's, as in vLLM and llama.cpp) divides the logit
of every token the prompt or the output holds when it is positive and multiplies it when it is
negative; then OpenAI's definition: logit[j] += logit_bias[j] - frequency_penalty * c[j]
- presence_penalty * (c[j] > 0), with c[j] the times token j appears in the output so far (the
prompt does not count, as in OpenAI's and vLLM's API). Under speculation "so far" differs per
node: the row of tree node i gives the next token after node i's path, so its counts are the
request's output plus the tokens on the path from the root (exclusive: it is already emitted or
the prompt's last token) down to node i. With every row adjusted by its own path, the verifier
samples each node from the distribution plain decoding would have used there, and the output
distribution stays exactly plain decoding's (greedy: the same tokens). The draft's proposals
need not be adjusted: the verifier accepts a proposal by the adjusted target over the q it was
drawn from, which is exact for any q.

ignore_eos bans the end-of-generation tokens, as llama.cpp's server does (its logit_bias_eog): their
logits become -inf in every row, so no node samples one and the request runs to max_tokens, a
stop string or its deadline. A ban is a bias like the others, applied to every row alike, so the
argument above holds unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from edgespec.sampling import SamplingParams
from edgespec.tree import DraftTree


def adjusts(s: SamplingParams) -> bool:
    """Does `s` change the target's logits at all?"""
    return bool(s.logit_bias) or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0 \
        or s.repetition_penalty != 1.0 or s.ignore_eos


def _penalty(s: SamplingParams, count: int) -> float:
    return s.frequency_penalty * count + (s.presence_penalty if count > 0 else 0.0)


class Adjuster:
    """One request's adjustment. Every adjusted logit is computed from rows[i, j] alone by one
    sequence of float32 operations that depends only on j, whether j is in the prompt, output or
    path (the repetition penalty) and its count in output + path: the same for plain decoding's
    row and a tree node's, so greedy speculation picks the same tokens bit for bit."""

    def __init__(self, s: SamplingParams, n_vocab: int, prompt: Sequence[int] = (), eog: Sequence[int] = ()):
        """`eog`: the model's end-of-generation tokens, banned when `s.ignore_eos`."""
        self.s = s
        self.n_vocab = n_vocab
        self._bias = dict(s.logit_bias)
        if s.ignore_eos:
            self._bias.update(dict.fromkeys((int(t) for t in eog), -np.inf))
        self.penalised = s.presence_penalty != 0.0 or s.frequency_penalty != 0.0
        self.rep = np.float32(s.repetition_penalty)
        self.repeating = s.repetition_penalty != 1.0
        # the prompt's tokens, which the repetition penalty counts: taken once per request
        self._prompt_seen = frozenset(int(t) for t in prompt) if self.repeating else frozenset()

    def _adj(self, tok: int, count: int) -> np.float32:
        return np.float32(self._bias.get(tok, 0.0) - _penalty(self.s, count))

    def _repeat(self, x):  # a float32 array or scalar
        """The repetition penalty (CTRL's, as in vLLM and llama.cpp): positive logits divided by
        it, negative ones multiplied."""
        return np.where(x > 0, x / self.rep, x * self.rep).astype(np.float32)

    def rows(self, rows: np.ndarray, tree: DraftTree, output: Sequence[int], *,
             inplace: bool = False) -> np.ndarray:
        """[n_nodes, n_vocab] the target's rows (node order) as plain decoding would sample from
        them at each node: the repetition penalty over prompt + output + the node's path, then
        bias and presence / frequency penalties over output + path. Only the touched columns
        change (a column nothing touches keeps its value; adding 0 would only turn -0 into +0);
        `inplace`: in the caller's array (a float32 array it owns), else in a copy."""
        rows = np.asarray(rows, dtype=np.float32)
        out = rows if inplace else rows.copy()
        counts: Counter = Counter(output) if self.penalised else Counter()
        seen = self._prompt_seen.union(output) if self.repeating else frozenset()
        fixes: list[tuple[int, int, np.float32]] = []  # node, token, value: read before any write
        if (self.penalised or self.repeating) and len(tree) > 1:
            path: list[dict[int, int]] = [{}] * len(tree)  # node -> its path's counts (root excluded)
            for i in range(1, len(tree)):  # a child always comes after its parent
                d = dict(path[tree.parents[i]])
                t = tree.tokens[i]
                d[t] = d.get(t, 0) + 1
                path[i] = d
                for tok, c in d.items():
                    x = rows[i, tok]
                    if self.repeating:
                        x = self._repeat(x)
                    fixes.append((i, tok, x + self._adj(tok, counts[tok] + c)))
        touched = sorted(set(self._bias) | set(counts) | seen)
        if touched:
            cols = np.asarray(touched, dtype=np.int64)
            x = rows[:, cols]
            if self.repeating:
                rep = np.fromiter((t in seen for t in touched), dtype=bool, count=len(touched))
                x[:, rep] = self._repeat(x[:, rep])
            out[:, cols] = x + np.fromiter((self._adj(t, counts[t]) for t in touched), dtype=np.float32,
                                           count=len(touched))
        for i, tok, v in fixes:
            out[i, tok] = v
        return out

    def row(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """One row adjusted after `history` (output + drafted path): plain decoding's row there,
        for a draft's proposals (their exactness does not depend on it; their acceptance does)."""
        return self.rows(np.asarray(logits)[None, :], DraftTree.root(0), history)[0]
