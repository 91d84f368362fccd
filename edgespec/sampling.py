"""Sampling parameters and the logits -> probabilities transform (pure numpy).

The distribution edgespec preserves is the target's distribution *after* these transforms
(temperature, top_k, top_p, min_p). Draft probabilities use the same transform so that q is
comparable to p. Temperature 0 means greedy: argmax of the raw logits, and so does any temperature
below GREEDY_BELOW (vLLM's sampling epsilon): logits / 5e-324 overflow to inf and the
"distribution" would be NaN; at 1e-5 sampling is greedy in all but exact ties anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgespec.errors import BadRequest

MAX_STOP_STRINGS = 16
GREEDY_BELOW = 1e-5  # a temperature in (0, GREEDY_BELOW) is taken as 0 (greedy)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # in (0, 1]
    min_p: float = 0.0  # in [0, 1)
    seed: int | None = None
    max_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        validate_sampling(self)
        if 0.0 < self.temperature < GREEDY_BELOW:  # denormals included: greedy, not NaN
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def validate_sampling(s: SamplingParams, max_tokens_limit: int = 1 << 20) -> None:
    """Raise BadRequest naming the field and its allowed range."""
    t = s.temperature
    if not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0 or t > 100:
        raise BadRequest("temperature", f"must be in [0, 100], got {t!r}")
    if not isinstance(s.top_k, int) or s.top_k < 0:
        raise BadRequest("top_k", f"must be an integer >= 0 (0 = off), got {s.top_k!r}")
    if not isinstance(s.top_p, (int, float)) or not (0.0 < s.top_p <= 1.0):
        raise BadRequest("top_p", f"must be in (0, 1], got {s.top_p!r}")
    if not isinstance(s.min_p, (int, float)) or not (0.0 <= s.min_p < 1.0):
        raise BadRequest("min_p", f"must be in [0, 1), got {s.min_p!r}")
    if s.seed is not None and (not isinstance(s.seed, int) or s.seed < 0 or s.seed >= 2**63):
        raise BadRequest("seed", f"must be an integer in [0, 2^63), got {s.seed!r}")
    if not isinstance(s.max_tokens, int) or not (1 <= s.max_tokens <= max_tokens_limit):
        raise BadRequest("max_tokens", f"must be in [1, {max_tokens_limit}], got {s.max_tokens!r}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise BadRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
    for i, st in enumerate(s.stop):
        if not isinstance(st, str) or not st:
            raise BadRequest(f"stop[{i}]", "must be a non-empty string")


def logits_to_probs(logits: np.ndarray, s: SamplingParams) -> np.ndarray:
    """[vocab] float logits -> [vocab] float64 probabilities after temperature/top_k/top_p/min_p.

    Greedy (temperature 0) returns the one-hot of the argmax. top_p keeps the smallest prefix of
    the tokens sorted by descending logit (ties: lower token id first) whose mass reaches top_p;
    min_p keeps the tokens whose probability is at least min_p times the top one's.
    """
    logits = np.asarray(logits, dtype=np.float64)
    n = logits.shape[-1]
    if s.greedy:
        out = np.zeros(n)
        out[int(np.argmax(logits))] = 1.0
        return out
    x = logits / s.temperature
    keep = None  # indices kept, sorted by descending logit, when a truncation applies
    if 0 < s.top_k < n:
        keep = np.argpartition(-x, s.top_k - 1)[: s.top_k]
    if s.top_p < 1.0 or s.min_p > 0.0:
        if keep is None:
            keep = _nucleus(x, s.top_p, s.min_p)
        else:
            cand = keep[np.argsort(-x[keep], kind="stable")]
            z = np.exp(x[cand] - x[cand[0]])
            keep = cand[: max(1, _prefix(z / z.sum(), s.top_p, s.min_p, complete=True))]
    if keep is None:
        z = np.exp(x - x.max())
        return z / z.sum()
    out = np.zeros(n)
    z = np.exp(x[keep] - x[keep].max())
    out[keep] = z / z.sum()
    return out


def _prefix(pc: np.ndarray, top_p: float, min_p: float, complete: bool) -> int | None:
    """How many of the tokens with probabilities `pc` (descending, the first being the top token)
    top_p / min_p keep. When `pc` is only the head of the distribution (`complete` False), a cut
    that may lie beyond the head is left out: each such cut keeps at least len(pc) tokens, so the
    smallest cut found inside the head is the answer; None if there is none."""
    cuts = []
    if min_p > 0.0:
        k = int(np.count_nonzero(pc >= min_p * pc[0]))
        if k < len(pc) or complete:
            cuts.append(k)
    if top_p < 1.0:
        k = int(np.searchsorted(np.cumsum(pc), top_p, side="left")) + 1
        if k <= len(pc) or complete:
            cuts.append(min(k, len(pc)))
    return min(cuts) if cuts else None


def _nucleus(x: np.ndarray, top_p: float, min_p: float) -> np.ndarray:
    """Token ids top_p / min_p keep from the whole vocabulary, by descending x (ties: lower id
    first). Sorts only the distribution's head: the tokens whose probability relative to the top
    one is at least 1e-3 (then 1e-6, 1e-10) -- a prefix of the sorted order, since exp is monotone --
    while the cut lies beyond it; a full sort of 49k logits cost 2.3 ms per verified node."""
    e = np.exp(x - x.max())
    total = e.sum()
    for floor in (1e-3, 1e-6, 1e-10):
        top = np.flatnonzero(e >= floor)  # ascending ids
        top = top[np.argsort(-x[top], kind="stable")]
        m = _prefix(e[top] / total, top_p, min_p, complete=len(top) == len(x))
        if m is not None:
            return top[: max(m, 1)]
    top = np.argsort(-x, kind="stable")
    return top[: max(1, _prefix(e[top] / total, top_p, min_p, complete=True))]


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a probability vector (inverse CDF; robust to tiny rounding). Walks the
    support only: zero-probability tokens add nothing to the CDF, so the draw is the same token
    the whole vector's CDF gives for the same uniform."""
    support = np.flatnonzero(probs)
    if len(support) == 0:
        return len(probs) - 1
    c = np.cumsum(probs[support])
    return int(support[min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(support) - 1)])
