"""Verification widths: where a forward of n tokens is cheapest to run, padded up.

A forward's cost T(n) need not grow with n. On a GPU, llama.cpp replays a forward as a CUDA graph
only once the same shape has come twice in a row, so a width that recurs can cost less than a
narrower one that does not; and the quantized mat-mul kernels change at a width: CUDA's MMVQ (a
vector kernel per token column) serves batches of up to 8 tokens, MMQ (tiled) anything wider, so
T(9) can sit well above T(8) and close to T(16). On a CPU, K-quant kernels work in tiles of
rows, so T(4) can come under T(2).

So n tokens are priced at the cheapest forward that holds them,

    cost(n) = min over m >= n of T(m)        (the lower envelope from the right)

and when that m is wider than n the forward is padded up to m (`pad_to`): its extra rows carry
no logits and their cells are dropped after it. `stable_width` rounds n up to one of a few fixed
widths, so that on a GPU the verification's shape repeats from step to step and its graph stays
warm; the default set's steps fall where the kernels change (8 is the last MMVQ width).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

# the fixed verification widths of a GPU: doubling, with 8 the widest MMVQ batch and 16 the first
# MMQ width beyond it
WIDTHS = (1, 2, 4, 8, 16, 32, 64)
MMVQ_MAX_TOKENS = 8
# pad only where the wider forward is measurably cheaper: timing noise must not move the width
PAD_MARGIN = 0.03


def stable_width(n: int, widths: Iterable[int] = WIDTHS) -> int:
    """The narrowest fixed width that holds n tokens (n itself beyond the widest)."""
    if n < 1:
        raise ValueError(f"a forward holds at least one token, got {n}")
    return min((w for w in widths if w >= n), default=n)


def pad_to(n: int, seconds: Callable[[int], float], candidates: Iterable[int],
           margin: float = PAD_MARGIN) -> int:
    """The width to run a forward of n tokens at: the cheapest of n and every candidate width
    above it by `seconds` (the raw, unsmoothed cost), the narrowest on ties; a wider one only where
    it saves more than `margin` of n's own cost."""
    own = seconds(n)
    best, best_s = n, own * (1.0 - margin)
    for m in sorted(set(candidates)):
        if m > n:
            s = seconds(m)
            if s < best_s:
                best, best_s = m, s
    return best


def envelope(table: dict[int, float]) -> dict[int, float]:
    """The table's lower envelope from the right: each size costs at most what a larger one does."""
    out, low = {}, float("inf")
    for n in sorted(table, reverse=True):
        low = out[n] = min(table[n], low)
    return dict(sorted(out.items()))
