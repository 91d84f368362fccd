"""Will speculation pay on this box? Forward costs measured, chain speedups computed.

A chain of k drafted tokens, each accepted with probability a (independently), verified in one
target forward of k+1 tokens, emits on average

    tokens(a, k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens (the accepted prefix plus the target's own next token), and costs

    cost(k) = T_target(k+1) + k * T_draft(1)

against T_target(1) per token for plain decoding, so

    speedup(a, k) = tokens(a, k) / cost(k) * T_target(1).

Break-even acceptance for depth k: the a where speedup(a, k) = 1 (speedup grows with a; a depth
whose speedup stays below 1 even at a = 1, i.e. k+1 tokens for cost(k), never pays). The ceiling at
acceptance a is the best depth's speedup.

With N streams decoding together, plain decoding verifies N tokens a forward and each stream's
chain adds k: the step costs T_target(N(k+1)) + k * T_draft(N) (a draft forward of N rows per
level) against T_target(N) for N plain tokens, so

    speedup_N(a, k) = tokens(a, k) / cost_N(k) * T_target(N).

On a GPU T(N(k+1)) stays near T(N) for small N; on a CPU it grows nearly with the tokens, which
is why a chain that pays alone stops paying beside other streams.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ACCEPTANCES = (0.6, 0.7, 0.8)
SIZES = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64)


def tokens_per_step(a: float, k: int) -> float:
    """Expected tokens one verification emits: the accepted prefix of k drafts plus one."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def step_cost(k: int, t_target: Mapping[int, float], t_draft: float, streams: int = 1) -> float:
    """Seconds of one step of `streams` depth-k chains: their verification in one target forward
    and k draft forwards of `streams` rows (`t_draft`: one such forward)."""
    return t_target[streams * (k + 1)] + k * t_draft


def speedup(a: float, k: int, t_target: Mapping[int, float], t_draft: float, streams: int = 1) -> float:
    """Tokens per second of depth-k chains over plain decoding's, `streams` decoding together
    (t_target must hold streams and streams * (k+1))."""
    return tokens_per_step(a, k) / step_cost(k, t_target, t_draft, streams) * t_target[streams]


def break_even(k: int, t_target: Mapping[int, float], t_draft: float, tol: float = 1e-4,
               streams: int = 1) -> float | None:
    """The acceptance at which depth-k chains match plain decoding; None if they never do."""
    if speedup(1.0, k, t_target, t_draft, streams) <= 1.0:  # not even k+1 tokens a step beat plain
        return None
    if speedup(0.0, k, t_target, t_draft, streams) >= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speedup(mid, k, t_target, t_draft, streams) < 1.0 else (lo, mid)
    return hi


@dataclass(frozen=True)
class Depth:
    k: int
    cost_ratio: float  # cost(k) / T_target(1)
    break_even: float | None
    speedups: dict[float, float]  # acceptance -> speedup


@dataclass(frozen=True)
class Economics:
    t_target: dict[int, float]  # n -> seconds of a target forward of n tokens
    t_draft: float  # seconds of one draft forward of `streams` rows (0: model-free drafting)
    acceptances: tuple[float, ...] = ACCEPTANCES
    depths: list[Depth] = field(default_factory=list)
    streams: int = 1  # streams decoding together

    def best(self, a: float) -> Depth:
        return max(self.depths, key=lambda d: d.speedups[a])

    @property
    def pays(self) -> bool:
        """Whether some depth beats plain decoding at the highest acceptance asked about."""
        return self.best(max(self.acceptances)).speedups[max(self.acceptances)] > 1.0

    def as_dict(self) -> dict:
        return {
            "t_target_seconds": {str(n): t for n, t in sorted(self.t_target.items())},
            "t_draft_seconds": self.t_draft,
            "streams": self.streams,
            "draft_share": self.t_draft / self.t_target[self.streams],
            "depths": [{"k": d.k, "cost_ratio": d.cost_ratio, "break_even": d.break_even,
                        "speedup": {str(a): s for a, s in d.speedups.items()}} for d in self.depths],
            "best": {str(a): {"k": self.best(a).k, "speedup": self.best(a).speedups[a]} for a in self.acceptances},
            "pays": self.pays,
        }


def economics(t_target: Mapping[int, float], t_draft: float,
              acceptances: Sequence[float] = ACCEPTANCES, streams: int = 1) -> Economics:
    """Every depth k whose verification width streams * (k+1) was measured."""
    if streams < 1:
        raise ValueError(f"streams must be at least 1, got {streams}")
    ks = sorted(n // streams - 1 for n in t_target if n > streams and n % streams == 0)
    if 1 not in t_target or streams not in t_target or not ks:
        raise ValueError(f"t_target needs n = 1, n = {streams} and at least one wider forward of a multiple of it")
    depths = [Depth(k, step_cost(k, t_target, t_draft, streams) / t_target[streams],
                    break_even(k, t_target, t_draft, streams=streams),
                    {a: speedup(a, k, t_target, t_draft, streams) for a in acceptances})
              for k in ks]
    return Economics(dict(t_target), t_draft, tuple(acceptances), depths, streams)


def stream_sizes(streams: int, sizes: Sequence[int] = SIZES, widest: int = 64) -> tuple[int, ...]:
    """The target widths `plan --measure` times for `streams` streams: `sizes` alone for one,
    else plain's width and every chain's, streams * (k+1), up to `widest`."""
    if streams <= 1:
        return tuple(sizes)
    return tuple(sorted({1, streams, *range(2 * streams, widest + 1, streams)}))


def drafter_verdict(t_target: Mapping[int, float], t_draft: float,
                    acceptances: Sequence[float] = ACCEPTANCES) -> dict | None:
    """What the engine's calibration says of one drafter: whether some chain pays at the highest
    acceptance asked about (`plan --measure`'s verdict, from the same arithmetic), the ceiling
    there and the draft's share of a target forward; None when the table is too short to judge.
    Where no chain pays, auto requests draft model-free (prompt n-grams, the suffix cache):
    the draft model's forwards cost more than its accepted tokens save on this box."""
    if 1 not in t_target or len(t_target) < 2 or t_target[1] <= 0:
        return None
    e = economics(t_target, t_draft, acceptances)
    a = max(e.acceptances)
    best = e.best(a)
    return {"pays": e.pays, "acceptance": a, "ceiling": round(best.speedups[a], 3), "depth": best.k,
            "draft_share": round(t_draft / t_target[1], 3),
            "break_even": None if best.break_even is None else round(best.break_even, 3)}


def render(e: Economics, draft_label: str = "draft") -> str:
    t1, n = e.t_target[1], e.streams
    at = "" if n == 1 else f" at {n} streams"
    if n == 1:
        head = [f"{draft_label}: one token {e.t_draft * 1e3:.2f} ms = {e.t_draft / t1:.1%} of a target forward"]
    else:
        head = [f"{draft_label}: a forward of {n} rows {e.t_draft * 1e3:.2f} ms = "
                f"{e.t_draft / e.t_target[n]:.1%} of a target forward of {n}",
                f"{n} streams: plain verifies {n} tokens a forward, chains of depth k verify {n}(k+1)"]
    lines = ["target forward cost T(n) (median):",
             "  n      " + "".join(f"{m:>7}" for m in sorted(e.t_target)),
             "  ms     " + "".join(f"{e.t_target[m] * 1e3:7.1f}" for m in sorted(e.t_target)),
             "  T(n)/T(1)" + "".join(f"{e.t_target[m] / t1:7.2f}" for m in sorted(e.t_target))[2:],
             *head,
             "",
             f"  k  cost/T({n})  break-even a  " + "  ".join(f"speedup a={a:g}" for a in e.acceptances)]
    for d in e.depths:
        be = "never" if d.break_even is None else f"{d.break_even:.2f}"
        lines.append(f"{d.k:>3}  {d.cost_ratio:9.2f}  {be:>12}  " +
                     "  ".join(f"{d.speedups[a]:>13.2f}" for a in e.acceptances))
    lines.append("")
    for a in e.acceptances:
        b = e.best(a)
        lines.append(f"ceiling at acceptance {a:g}: {b.speedups[a]:.2f}x plain{at} (chain depth {b.k})")
    amax = max(e.acceptances)
    if not e.pays:
        lines.append(f"no chain depth pays on this box with this draft{at}, even at acceptance {amax:g}: "
                     "serve plain, or model-free drafts only where their acceptance is high")
    return "\n".join(lines)


# --- measuring -------------------------------------------------------------------------------------


def _context_tokens(n_vocab: int, context: int) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(0).integers(100, min(n_vocab, 20_000), context)]


class _Timer:
    """One model's context holding `context` tokens; times forwards of n tokens after them (every
    row's logits, as verification reads them) and drops their cells again."""

    def __init__(self, path: Path, context: int, threads: int | None, n_max: int, n_gpu_layers: int = 0,
                 repack: bool = True, flash_attn: bool = True):
        from edgespec import backend
        from edgespec.config import ModelConfig

        self.model = backend.Model(path, n_gpu_layers=n_gpu_layers, repack=repack)
        cfg = ModelConfig(path=str(path), n_ctx=context + n_max + 16, n_batch=max(512, n_max),
                          threads=threads or 0, n_gpu_layers=n_gpu_layers, flash_attn=flash_attn)
        self.ctx = backend.Context(self.model, cfg)
        self.context = context
        self.toks = _context_tokens(self.model.n_vocab, context + n_max)
        for s in range(0, context, 256):
            e = min(context, s + 256)
            self.ctx.decode_rows(self.toks[s:e], list(range(s, e)), [(0,)] * (e - s), [False] * (e - s - 1) + [True])

    def __call__(self, n: int, alternate: bool = False, repeat: int = 0) -> float:
        for _ in range(repeat):  # untimed forwards of the same shape first
            self._forward(n)
        if alternate:  # a one-token forward first: the shape changes before every timed forward
            self._forward(1)
        return self._forward(n)

    def _forward(self, n: int) -> float:
        """Seconds of one forward of n tokens after the context (its cells dropped after)."""
        p = self.context
        t0 = time.perf_counter()
        self.ctx.decode_rows(self.toks[p:p + n], list(range(p, p + n)), [(0,)] * n, [True] * n)
        dt = time.perf_counter() - t0
        self.ctx.seq_rm(0, p, -1)
        return dt

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


def measure(models: Sequence[tuple[Path, Sequence[int]]], context: int = 256, rounds: int = 5,
            threads: int | None = None, n_gpu_layers: int = 0, alternate: bool = False, n_targets: int = 1,
            flash_attn: bool = True, repeat: int = 0,
            log: Callable[[str], None] = lambda s: None) -> list[dict[int, float]]:
    """Median seconds of a forward of n tokens after `context` tokens, for each (model, sizes).
    The models and sizes take turns within every round, so a neighbour's load falls on all alike;
    the ratios between them mean more than any one figure. `alternate`: each timed forward follows
    an untimed one-token forward of the same model (a GPU's cached graphs then meet a new shape
    every call, as a target that verifies between draft steps does). `repeat`: each timed forward
    follows that many untimed forwards of its own size (steady shapes: llama.cpp replays a CUDA
    graph once two identical calls have warmed it; with `alternate` the one-token forward still
    comes last, so the timed shape is always new). The first `n_targets` models
    are loaded as the engine loads a target (on a CPU with ggml's repacked layouts only where
    their kernels are batch-invariant, for exact verification: edgespec/engine.py), the others
    as drafts. `flash_attn`: off for a CUDA build without its flash-attention kernels
    (GGML_CUDA_FA=OFF)."""
    from edgespec import backend

    timers = [_Timer(p, context, threads, max(sizes), n_gpu_layers,
                     repack=i >= n_targets or backend.target_repack(p, n_gpu_layers), flash_attn=flash_attn)
              for i, (p, sizes) in enumerate(models)]
    try:
        for t, (_, sizes) in zip(timers, models):  # warm-up: buffers allocated, pages faulted in
            t(max(sizes))
            t(1)
        samples: list[dict[int, list[float]]] = [{n: [] for n in sizes} for _, sizes in models]
        every = sorted({n for _, sizes in models for n in sizes})
        for r in range(rounds):
            for n in every:
                for t, s in zip(timers, samples):
                    if n in s:
                        s[n].append(t(n, alternate, repeat))
            log(f"round {r + 1}/{rounds}")
        return [{n: statistics.median(v) for n, v in s.items()} for s in samples]
    finally:
        for t in timers:
            t.close()
