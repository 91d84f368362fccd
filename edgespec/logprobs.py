"""Log-probabilities of emitted tokens, from the rows that verified them (pure numpy).

The k-th token a step emits was checked against the target row of its parent node: the root for
the first, then each accepted node. Those rows are the target's own distribution at that context
whatever the mode, so logprobs are the same in plain and speculative decoding. They are reported
under the distribution decoding samples from: the transformed one (temperature, top_k, top_p,
min_p) at temperature > 0, the raw softmax at temperature 0 (where the transform is a one-hot).
"""

from __future__ import annotations

import numpy as np

from edgespec.sampling import SamplingParams, logits_to_probs
from edgespec.types import TokenLogprob


def log_distribution(row: np.ndarray, sampling: SamplingParams) -> np.ndarray:
    """[vocab] log-probabilities (float64; -inf outside the support)."""
    x = np.asarray(row, dtype=np.float64)
    if sampling.greedy:
        m = x.max()
        return x - (m + np.log(np.exp(x - m).sum()))
    with np.errstate(divide="ignore"):
        return np.log(logits_to_probs(x, sampling))


def token_logprob(row: np.ndarray, sampling: SamplingParams, token: int, k: int) -> TokenLogprob:
    lp = log_distribution(row, sampling)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, len(lp))
        idx = np.argpartition(-lp, k - 1)[:k]
        idx = idx[np.lexsort((idx, -lp[idx]))]  # best first, ties by token id
        top = tuple((int(i), float(lp[i])) for i in idx if np.isfinite(lp[i]))  # a masked row: allowed only
    return TokenLogprob(int(token), float(lp[token]), top)
