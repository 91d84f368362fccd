"""The serving benchmark's maths: what one streamed request's chunk arrival times say (time to
first token, inter-token latency, decode rate), a cell's aggregate over many concurrent
requests, and a window's latencies (the streams decoding while a long prompt prefills). Pure:
no I/O, no clock; the clients record the times, these functions read them.

How a chunk of several tokens counts (an edgespec stream chunk carries every token one engine
step accepted; llama-server sends one event per token, but its accepted draft tokens leave
within microseconds of each other): every token arrives when the chunk carrying it arrives.
The inter-token latency (ITL) of a token is its arrival minus the previous token's arrival in
the same request, so the tokens after the first of a chunk have ITL 0 and the chunk's wait is
counted once, on its first token. That is the same for both servers whatever their chunking,
and it is what a reader of the stream sees. The mean ITL of a request is its time per output
token (TPOT). `delivery gaps` are the waits between deliveries: tokens arriving within
BURST_SECONDS of the previous one are one delivery; their p99 is the stall a reader notices.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BURST_SECONDS = 0.001  # tokens this close to the previous one arrived in the same delivery


@dataclass
class Trace:
    """One streamed request as the client saw it. Times are seconds on one monotonic clock."""

    system: str
    prompt_id: str
    submitted: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens in the chunk)
    completion_tokens: int | None = None  # the server's own count (final chunk), when it gives one
    prompt_tokens: int | None = None
    finish_reason: str = ""
    speculation: dict[str, float] = field(default_factory=dict)  # tau, accepted / drafted tokens, forwards
    error: str | None = None

    @property
    def tokens(self) -> int:
        """Completion tokens: the server's count, else the tokens the chunks carried."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        return sum(n for _, n in self.arrivals)

    @property
    def finished(self) -> float | None:
        return self.arrivals[-1][0] if self.arrivals else None


def token_times(arrivals: Sequence[tuple[float, int]]) -> list[float]:
    """The arrival time of every token: a chunk of k tokens gives k equal times."""
    out: list[float] = []
    for t, n in arrivals:
        out.extend([t] * n)
    return out


def itl(times: Sequence[float]) -> list[float]:
    """Inter-token latencies: token i's arrival minus token i-1's (len(times) - 1 values)."""
    return [b - a for a, b in zip(times, times[1:])]


def delivery_gaps(times: Sequence[float], burst: float = BURST_SECONDS) -> list[float]:
    """Waits between deliveries: the inter-token gaps longer than `burst`."""
    return [g for g in itl(times) if g > burst]


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation between order statistics); None if empty."""
    v = list(values)
    if not v:
        return None
    return float(np.percentile(np.asarray(v, dtype=float), q))


def median(values: Iterable[float | None]) -> float | None:
    v = [x for x in values if x is not None]
    return percentile(v, 50)


def request_metrics(tr: Trace) -> dict[str, Any]:
    """One request: tokens, TTFT, end-to-end latency, decode rate ((n - 1) / (last - first))."""
    times = token_times(tr.arrivals)
    out: dict[str, Any] = {"prompt_id": tr.prompt_id, "tokens": tr.tokens, "error": tr.error,
                           "finish_reason": tr.finish_reason}
    if tr.prompt_tokens is not None:
        out["prompt_tokens"] = tr.prompt_tokens
    if not times:
        return {**out, "ttft_s": None, "latency_s": None, "tpot_s": None, "tokens_per_second": None}
    decode = times[-1] - times[0]
    tpot = decode / (len(times) - 1) if len(times) > 1 else None
    return {**out,
            "ttft_s": times[0] - tr.submitted,
            "latency_s": times[-1] - tr.submitted,
            "tpot_s": tpot,
            "tokens_per_second": (len(times) - 1) / decode if decode > 0 else None,
            **({"speculation": dict(tr.speculation)} if tr.speculation else {})}


def _rounded(d: dict[str, Any], digits: int = 6) -> dict[str, Any]:
    return {k: (round(v, digits) if isinstance(v, float) else v) for k, v in d.items()}


def cell_metrics(traces: Sequence[Trace], wall_seconds: float) -> dict[str, Any]:
    """A batch of requests run `wall_seconds` at some concurrency: aggregate throughput (all
    completion tokens / wall time), the median request's decode rate, TTFT and ITL percentiles
    (ITL pooled over every token of every request), delivery gaps, speculation stats."""
    ok = [t for t in traces if t.error is None]
    per = [request_metrics(t) for t in ok]
    tokens = sum(t.tokens for t in ok)
    all_itl: list[float] = []
    all_gaps: list[float] = []
    for t in ok:
        times = token_times(t.arrivals)
        all_itl += itl(times)
        all_gaps += delivery_gaps(times)
    out: dict[str, Any] = {
        "requests": len(traces),
        "errors": len(traces) - len(ok),
        "completion_tokens": tokens,
        "wall_seconds": wall_seconds,
        "tokens_per_second": tokens / wall_seconds if wall_seconds > 0 else None,
        "request_tokens_per_second_p50": median(m["tokens_per_second"] for m in per),
        "ttft_p50_s": percentile((m["ttft_s"] for m in per if m["ttft_s"] is not None), 50),
        "ttft_p99_s": percentile((m["ttft_s"] for m in per if m["ttft_s"] is not None), 99),
        "itl_p50_s": percentile(all_itl, 50),
        "itl_p99_s": percentile(all_itl, 99),
        "tpot_mean_s": float(np.mean(all_itl)) if all_itl else None,
        "delivery_gap_p50_s": percentile(all_gaps, 50),
        "delivery_gap_p99_s": percentile(all_gaps, 99),
    }
    out.update(speculation_summary(ok))
    return _rounded(out)


def speculation_summary(traces: Sequence[Trace]) -> dict[str, Any]:
    """Token-weighted tau (all emitted tokens / all target forwards) and acceptance over the
    requests that report them (edgespec: tau, target_forwards; llama-server: drafted/accepted)."""
    out: dict[str, Any] = {}
    fwd = [(t.tokens, t.speculation["target_forwards"]) for t in traces if t.speculation.get("target_forwards")]
    if fwd:
        out["tau"] = sum(n for n, _ in fwd) / sum(f for _, f in fwd)
    drafted = sum(t.speculation.get("drafted_tokens", 0) for t in traces)
    accepted = sum(t.speculation.get("accepted_tokens", 0) for t in traces)
    if drafted:
        out["drafted_tokens"] = int(drafted)
        out["accepted_tokens"] = int(accepted)
        out["acceptance"] = accepted / drafted
    return out


def window_gaps(traces: Sequence[Trace], start: float, end: float, burst: float = BURST_SECONDS) -> list[float]:
    """The delivery gaps of `traces` that overlap the window [start, end]: a gap from token
    i-1 to token i counts when token i arrives after `start` and token i-1 before `end`, so a
    stall spanning the whole window counts once, at its full length. Tokens of one delivery
    (within `burst`) add no zero gaps: in a window of a few deliveries those would make the
    median say nothing."""
    out: list[float] = []
    for t in traces:
        times = token_times(t.arrivals)
        out += [b - a for a, b in zip(times, times[1:]) if b > start and a < end and b - a > burst]
    return out


def window_metrics(streams: Sequence[Trace], long: Trace) -> dict[str, Any]:
    """The long request's TTFT, and the streams' inter-token latency while it prefilled (its
    submission to its first token), per delivery: p50, p99 and max over the gaps overlapping
    that window; the same before it, for comparison."""
    times = token_times(long.arrivals)
    if long.error is not None or not times:
        return {"error": long.error or "the long request produced no token"}
    start, end = long.submitted, times[0]
    gaps = window_gaps(streams, start, end)
    before = [g for t in streams for g in delivery_gaps([x for x in token_times(t.arrivals) if x <= start])]
    running = sum(1 for t in streams if t.finished is not None and t.finished >= end)
    return _rounded({
        "long_prompt_tokens": long.prompt_tokens,
        "long_ttft_s": end - start,
        "streams": len(streams),
        "streams_decoding_throughout": running,
        "window_gaps": len(gaps),
        "window_itl_p50_s": percentile(gaps, 50),
        "window_itl_p99_s": percentile(gaps, 99),
        "window_itl_max_s": max(gaps) if gaps else None,
        "before_itl_p50_s": percentile(before, 50),
        "before_itl_p99_s": percentile(before, 99),
    })


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None
