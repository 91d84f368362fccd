"""Sampling parameters and the logits -> probabilities transform (pure numpy).

The distribution edgespec preserves is the target's distribution *after* these transforms
(temperature, top_k, top_p, min_p). Draft probabilities use the same transform so that q is
comparable to p. Temperature 0 means greedy: argmax of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgespec.errors import BadRequest

MAX_STOP_STRINGS = 16


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

    Greedy (temperature 0) returns the one-hot of the argmax.
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
        cand = keep if keep is not None else np.arange(n)
        cand = cand[np.argsort(-x[cand], kind="stable")]
        z = x[cand] - x[cand[0]]
        pc = np.exp(z)
        pc /= pc.sum()
        m = len(cand)
        if s.min_p > 0.0:
            m = min(m, int(np.count_nonzero(pc >= s.min_p * pc[0])))
        if s.top_p < 1.0:
            # smallest prefix whose mass reaches top_p (always keeps at least one token)
            m = min(m, int(np.searchsorted(np.cumsum(pc), s.top_p, side="left")) + 1)
        keep = cand[: max(m, 1)]
    if keep is None:
        z = np.exp(x - x.max())
        return z / z.sum()
    out = np.zeros(n)
    z = np.exp(x[keep] - x[keep].max())
    out[keep] = z / z.sum()
    return out


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a probability vector (inverse CDF; robust to tiny rounding)."""
    c = np.cumsum(probs)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(probs) - 1))
