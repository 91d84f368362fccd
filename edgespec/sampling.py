"""Sampling parameters and the logits -> probabilities transform (pure numpy).

The distribution edgespec preserves is the target's distribution *after* these transforms
(temperature, top_k, top_p, min_p). Draft probabilities use the same transform so that q is
comparable to p. Temperature 0 means greedy: argmax of the raw logits, and so does any temperature
below GREEDY_BELOW (vLLM's sampling epsilon): logits / 5e-324 overflow to inf and the
"distribution" would be NaN; at 1e-5 sampling is greedy in all but exact ties anyway.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgespec.errors import BadRequest
from edgespec.settings import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_STOP_STRINGS, SAMPLING, check_fields, check_stop

GREEDY_BELOW = 1e-5  # a temperature in (0, GREEDY_BELOW) is taken as 0 (greedy)


@dataclass(frozen=True)
class SamplingParams:
    """Defaults and ranges: edgespec.settings.SAMPLING."""

    temperature: float = SAMPLING["temperature"].default
    top_k: int = SAMPLING["top_k"].default  # 0 = off
    top_p: float = SAMPLING["top_p"].default  # in (0, 1]
    min_p: float = SAMPLING["min_p"].default  # in [0, 1)
    seed: int | None = SAMPLING["seed"].default
    max_tokens: int = SAMPLING["max_tokens"].default
    stop: tuple[str, ...] = field(default_factory=tuple)
    presence_penalty: float = SAMPLING["presence_penalty"].default
    frequency_penalty: float = SAMPLING["frequency_penalty"].default
    repetition_penalty: float = SAMPLING["repetition_penalty"].default
    # ((token id, bias), ...) sorted by id (a mapping is accepted and converted); see penalties.py
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # end-of-generation tokens get no probability (their logits -inf, as llama.cpp's ignore_eos):
    # the request ends only at max_tokens, a stop string or its deadline; see penalties.py
    ignore_eos: bool = SAMPLING["ignore_eos"].default

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", parse_logit_bias(self.logit_bias))
        validate_sampling(self)
        if 0.0 < self.temperature < GREEDY_BELOW:  # denormals included: greedy, not NaN
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def validate_sampling(s: SamplingParams, max_tokens_limit: int = 1 << 20) -> None:
    """Raise BadRequest naming the field and its allowed range."""
    check_sampling(s.__dict__, max_tokens_limit=max_tokens_limit)


def check_sampling(values: dict, *, prefix: str = "", max_tokens_limit: int = 1 << 20,
                   max_stop_strings: int = MAX_STOP_STRINGS, max_stop_chars: int | None = None) -> None:
    """The one check of a request's sampling fields, for gRPC, HTTP and the CLI: each field of
    `values` (temperature, top_k, top_p, min_p, seed, max_tokens, stop; None = unset) in its
    declared range (edgespec.settings.SAMPLING), max_tokens at most `max_tokens_limit`. BadRequest
    names the field as the caller's API does (`prefix`: "sampling." for gRPC)."""
    check_fields({k: v for k, v in values.items() if k in SAMPLING}, SAMPLING, prefix=prefix,
                 caps={"max_tokens": max_tokens_limit})
    check_stop(values.get("stop", ()), prefix=prefix, max_strings=max_stop_strings, max_chars=max_stop_chars)
    parse_logit_bias(values.get("logit_bias"), prefix=prefix)


def parse_logit_bias(value: Any, *, prefix: str = "") -> tuple[tuple[int, float], ...]:
    """logit_bias as a request gives it (a mapping of token id, or its decimal string as in
    OpenAI's JSON, to a bias; or (id, bias) pairs; None or empty: none) -> sorted (id, bias)
    pairs. At most MAX_LOGIT_BIAS entries, ids >= 0 (the engine checks them against its
    vocabulary), biases finite in [-100, 100]. BadRequest names the entry."""
    if value is None or (hasattr(value, "__len__") and len(value) == 0):
        return ()
    field_name = prefix + "logit_bias"
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise BadRequest(field_name, "must be an object mapping token ids to biases")
    if len(items) > MAX_LOGIT_BIAS:
        raise BadRequest(field_name, f"at most {MAX_LOGIT_BIAS} entries, got {len(items)}")
    out: dict[int, float] = {}
    for item in items:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise BadRequest(field_name, "must be an object mapping token ids to biases")
        k, b = item
        try:
            tok = int(k, 10) if isinstance(k, str) else k
            if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)) or tok < 0:
                raise ValueError
        except ValueError:
            raise BadRequest(f"{field_name}.{k}", "keys must be token ids (integers >= 0)") from None
        if isinstance(b, bool) or not isinstance(b, (int, float, np.floating, np.integer)) \
                or not math.isfinite(float(b)) or abs(float(b)) > LOGIT_BIAS_RANGE:
            raise BadRequest(f"{field_name}.{k}", f"must be a number in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")
        out[int(tok)] = float(b)
    return tuple(sorted(out.items()))


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
            keep = cand[: max(1, _prefix(z / z.sum(), s.top_p, s.min_p, complete=True) or 1)]
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
    while the cut lies beyond it, instead of sorting the whole vocabulary for every verified node."""
    e = np.exp(x - x.max())
    total = e.sum()
    for floor in (1e-3, 1e-6, 1e-10):
        top = np.flatnonzero(e >= floor)  # ascending ids
        top = top[np.argsort(-x[top], kind="stable")]
        m = _prefix(e[top] / total, top_p, min_p, complete=len(top) == len(x))
        if m is not None:
            return top[: max(m, 1)]
    top = np.argsort(-x, kind="stable")
    return top[: max(1, _prefix(e[top] / total, top_p, min_p, complete=True) or 1)]


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a probability vector (inverse CDF; robust to tiny rounding). Walks the
    support only: zero-probability tokens add nothing to the CDF, so the draw is the same token
    the whole vector's CDF gives for the same uniform."""
    support = np.flatnonzero(probs)
    if len(support) == 0:
        return len(probs) - 1
    c = np.cumsum(probs[support])
    return int(support[min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(support) - 1)])
