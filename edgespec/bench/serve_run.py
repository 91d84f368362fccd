"""The serving benchmark's loop. For each concurrency level N: start the servers for N (an
edgespec daemon with parallel = N, llama-server -np N with and without the draft), warm each up,
then run rounds; in round r the systems take turns in the order rotated by r (A B C D, B C D A,
...), each running the same requests/rounds requests with N client threads (each thread takes
the next prompt of the suite when its previous request ends). A cell's figures are the median
over its rounds (throughput) or pooled over its requests (latency percentiles); ratios are
taken round by round, so drift between rounds cancels.

The scenario: 3 streams decode and, once each has its first few tokens, a ~2000-token prompt
arrives; the streams' inter-token gaps during its prefill (submission to first token) and its
time to first token are what a batched engine with chunked prefill is meant to improve.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from edgespec.bench.runner import mode_order
from edgespec.bench.serve_stats import Trace, cell_metrics, median, ratio, request_metrics, window_metrics
from edgespec.bench.suite import Prompt
from edgespec.errors import BadRequest

# (numerator, denominator): the ratios a reader looks for, when both systems ran
RATIO_PAIRS = (("edgespec-auto", "edgespec-plain"), ("edgespec-plain", "llama-server"),
               ("edgespec-auto", "llama-server"), ("edgespec-auto", "llama-server-draft"),
               ("llama-server-draft", "llama-server"))
EDGESPEC_SYSTEMS = ("edgespec-auto", "edgespec-plain")
LLAMA_SYSTEMS = ("llama-server", "llama-server-draft")
WARMUP_TOKENS = 8
WARMUP_AFTER = (0, 10, 30, 100)  # the warm-up curve's points: requests of the stream before

# the scenario's decoding streams: requests that answer at length
STREAM_PROMPTS = (
    Prompt("stream-story", "stream", "Write a long story about a lighthouse keeper who finds a message in a bottle. "
                                     "Describe every day of the first week."),
    Prompt("stream-code", "stream", "Write a Python module implementing a binary search tree with insert, delete, "
                                    "search, in-order traversal and a test for each, with comments."),
    Prompt("stream-essay", "stream", "Explain in detail how a compiler works, stage by stage, from lexing to code "
                                     "generation, with an example for each stage."),
)


class Client(Protocol):
    system: str

    def stream(self, prompt_id: str, prompt: str, max_tokens: int, tokens: Sequence[int] = (),
               on_chunk: Callable[[Trace], None] | None = None) -> Trace: ...

    def close(self) -> None: ...


@dataclass
class Level:
    """The started systems of one concurrency level and how to stop them."""

    clients: dict[str, Client]
    stop: Callable[[], None]
    info: dict[str, Any] = field(default_factory=dict)  # commands, daemon model info
    # what the daemon's drafts did over the level (drafts by source, the suffix cache), read before stop
    draft_stats: Callable[[], dict[str, Any]] | None = None


def run_batch(client: Client, prompts: Sequence[Prompt], start: int, count: int, concurrency: int,
              max_tokens: int, tokens: dict[str, list[int]], on_done: Callable[[Trace], None] | None = None
              ) -> tuple[list[Trace], float]:
    """`count` requests, prompts start, start+1, ... (cyclic), `concurrency` at a time: each
    client thread takes the next one when its request ends. Returns traces and wall seconds."""
    lock = threading.Lock()
    nxt = [0]
    traces: list[Trace] = []

    def worker() -> None:
        while True:
            with lock:
                i = nxt[0]
                if i >= count:
                    return
                nxt[0] += 1
            p = prompts[(start + i) % len(prompts)]
            tr = client.stream(p.id, p.prompt, max_tokens, tokens.get(p.id, ()))
            with lock:
                traces.append(tr)
            if on_done is not None:
                on_done(tr)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, count))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return traces, time.perf_counter() - t0


def run_scenario(client: Client, streams: Sequence[Prompt], long: Prompt, tokens: dict[str, list[int]], *,
                 stream_tokens: int, long_tokens: int, warm_tokens: int = 4,
                 wait_seconds: float = 600.0) -> dict[str, Any]:
    """len(streams) requests decode; when each has `warm_tokens` tokens, `long` is submitted.
    Returns window_metrics plus the raw request metrics."""
    ready = [threading.Event() for _ in streams]
    traces: list[Trace | None] = [None] * len(streams)

    def on_chunk(k: int) -> Callable[[Trace], None]:
        def seen(tr: Trace) -> None:
            if sum(n for _, n in tr.arrivals) >= warm_tokens:
                ready[k].set()
        return seen

    def stream(k: int, p: Prompt) -> None:
        try:
            traces[k] = client.stream(p.id, p.prompt, stream_tokens, tokens.get(p.id, ()), on_chunk(k))
        finally:
            ready[k].set()  # an early end (EOS, error) must not hang the scenario

    threads = [threading.Thread(target=stream, args=(k, p), daemon=True) for k, p in enumerate(streams)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    for e in ready:
        e.wait(max(0.0, wait_seconds - (time.monotonic() - t0)))
    long_trace = client.stream(long.id, long.prompt, long_tokens, tokens.get(long.id, ()))
    for t in threads:
        t.join(wait_seconds)
    got = [t for t in traces if t is not None]
    out = window_metrics(got, long_trace)
    out["stream_errors"] = [t.error for t in got if t.error]
    out["requests"] = [request_metrics(t) for t in got] + [request_metrics(long_trace)]
    return out


def long_prompt(tokenize: Callable[[str], list[int]], source: Sequence[Prompt], n_tokens: int,
                question: str = "\n\nSummarise the text above in one sentence.") -> Prompt:
    """A prompt of about `n_tokens` tokens (chat template included): the suite's texts joined,
    cut at the character count whose tokenization comes closest below (bisection), then a
    question. `tokenize` gives the tokens of a user message."""
    text = "\n\n".join(p.prompt for p in source)
    while len(tokenize(text + question)) < n_tokens:
        text = text + "\n\n" + text
    lo, hi = 0, len(text)
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if len(tokenize(text[:mid] + question)) <= n_tokens:
            lo = mid
        else:
            hi = mid
    return Prompt(f"long-{n_tokens}", "long", text[:lo] + question)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="bench-serve", unit="req", file=sys.stderr, dynamic_ncols=True)


def run_levels(start_level: Callable[[int], Level], systems: Sequence[str], prompts: Sequence[Prompt],
               concurrency: Sequence[int], *, requests: int, rounds: int, max_tokens: int, progress: bool = True,
               log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every concurrency level, systems interleaved by rounds (see the module docstring)."""
    if requests < 1 or rounds < 1 or rounds > requests:
        raise BadRequest("rounds", f"need 1 <= rounds <= requests, got rounds {rounds}, requests {requests}")
    per_round = [requests // rounds + (1 if r < requests % rounds else 0) for r in range(rounds)]
    bar = _progress(len(concurrency) * len(systems) * requests, progress)
    levels: list[dict[str, Any]] = []
    try:
        for n in concurrency:
            if log:
                log(f"concurrency {n}: starting {', '.join(systems)}")
            level = start_level(n)
            try:
                tokens = level.info.get("tokens", {})
                for name in systems:  # one unrecorded request each: first-request costs stay out
                    level.clients[name].stream(prompts[0].id, prompts[0].prompt, WARMUP_TOKENS,
                                               tokens.get(prompts[0].id, ()))
                cells: dict[str, list[tuple[list[Trace], float]]] = {s: [] for s in systems}
                start = 0
                for r, count in enumerate(per_round):
                    for name in mode_order(list(systems), r):
                        def done(tr: Trace, name: str = name, n: int = n) -> None:
                            if bar is not None:
                                bar.set_postfix_str(f"N={n} {name} {tr.tokens} tok", refresh=False)
                                bar.update(1)
                        cells[name].append(run_batch(level.clients[name], prompts, start, count, n, max_tokens,
                                                     tokens, done))
                    start += count
                if level.draft_stats is not None:
                    try:
                        level.info["drafts"] = level.draft_stats()
                    except Exception as exc:  # a figure for the report; never lose the run over it
                        level.info["drafts"] = {"error": str(exc)}
            finally:
                level.stop()
            levels.append(summarize_level(n, cells, level.info, per_round))
    finally:
        if bar is not None:
            bar.close()
    return levels


def summarize_level(n: int, cells: dict[str, list[tuple[list[Trace], float]]], info: dict[str, Any],
                    per_round: Sequence[int] = ()) -> dict[str, Any]:
    """Per system: the median round throughput, each round's, the pooled cell (all its
    requests, all its wall time: the latency percentiles) and every request; ratios are the
    median of per-round ratios (the same round's requests, back to back). With `per_round`
    (requests in each round) also the warm-up curve (`warmup_curve`)."""
    rounds = {name: [cell_metrics(traces, wall) for traces, wall in batches] for name, batches in cells.items()}
    systems: dict[str, Any] = {}
    for name, batches in cells.items():
        systems[name] = {
            "tokens_per_second": median(c["tokens_per_second"] for c in rounds[name]),
            "rounds_tokens_per_second": [c["tokens_per_second"] for c in rounds[name]],
            "pooled": cell_metrics([t for traces, _ in batches for t in traces], sum(w for _, w in batches)),
            "requests": [request_metrics(t) for traces, _ in batches for t in traces],
        }
    ratios = {}
    for a, b in RATIO_PAIRS:
        if a in rounds and b in rounds:
            per = [ratio(x["tokens_per_second"], y["tokens_per_second"]) for x, y in zip(rounds[a], rounds[b])]
            ratios[f"{a} / {b}"] = {"median": median(per), "rounds": per}
    out = {"concurrency": n, "systems": systems, "ratios": ratios, **_public(info)}
    if len(per_round) > 1 and ratios:
        out["warmup_curve"] = warmup_curve(cells, per_round)
    return out


def warmup_curve(cells: dict[str, list[tuple[list[Trace], float]]], per_round: Sequence[int],
                 after: Sequence[int] = WARMUP_AFTER) -> dict[str, dict[str, float | None]]:
    """Each ratio pair over the rounds that start after N earlier requests of the stream (a
    repetitive suite with the suffix cache: what the cache gives once it has seen N requests),
    for each N of `after` that some round starts at or beyond: aggregate tokens/s of those
    rounds pooled (their tokens over their wall time), numerator over denominator."""
    starts = [sum(per_round[:r]) for r in range(len(per_round))]
    curve: dict[str, dict[str, float | None]] = {}
    for a, b in RATIO_PAIRS:
        if a not in cells or b not in cells:
            continue
        points = {}
        for n in after:
            rounds = [r for r, st in enumerate(starts) if st >= n]
            if not rounds:
                continue

            def rate(name: str, rounds: list[int] = rounds) -> float:
                return cell_metrics([t for r in rounds for t in cells[name][r][0]],
                                    sum(cells[name][r][1] for r in rounds))["tokens_per_second"]
            points[str(n)] = ratio(rate(a), rate(b))
        curve[f"{a} / {b}"] = points
    return curve


def drafts_since(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The daemon's draft figures over a level: tokens proposed and accepted by source since
    `before` (Admin.Stats counts from the daemon's start), with each source's acceptance, and
    the suffix cache's figures now, the prompt store's (its hits over the level), and with a head
    beside the draft model the requests each drafted for."""
    out: dict[str, Any] = {"by_source": {}, "suffix_cache": dict(now.get("suffix_cache", {}))}
    store, was_store = now.get("prompt_store") or {}, before.get("prompt_store") or {}
    if store:  # entries and bytes now; the counters (hits, tokens written back, ...) over the level
        out["prompt_store"] = {k: v - (0 if k in ("entries", "bytes") else was_store.get(k, 0))
                               for k, v in store.items()}
    was = before.get("requests_by_drafter", {})
    mix = {k: int(n - was.get(k, 0)) for k, n in now.get("requests_by_drafter", {}).items()}
    if any(mix.values()):
        out["requests_by_drafter"] = mix
    for src, n in now.get("proposed_by_source", {}).items():
        proposed = n - before.get("proposed_by_source", {}).get(src, 0)
        accepted = now.get("accepted_by_source", {}).get(src, 0) - before.get("accepted_by_source", {}).get(src, 0)
        if proposed > 0:
            out["by_source"][src] = {"proposed": proposed, "accepted": accepted, "acceptance": accepted / proposed}
    return out


def _public(info: dict[str, Any]) -> dict[str, Any]:
    """A level's info for the report (not the token ids or the prompt objects)."""
    return {k: v for k, v in info.items() if k not in ("tokens", "long_prompt")}


def run_scenarios(start_level: Callable[[int], Level], systems: Sequence[str], *, rounds: int, stream_tokens: int, long_tokens: int, log: Callable[[str], None] | None = None
                  ) -> dict[str, Any]:
    """The long-prompt scenario for every system, interleaved by rounds, at parallel = 4
    (`start_level` puts the long prompt in its info as "long_prompt")."""
    streams = list(STREAM_PROMPTS)
    level = start_level(len(streams) + 1)
    out: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    try:
        long: Prompt = level.info["long_prompt"]  # built with the started daemon's tokenizer
        if log:
            log(f"scenario: {len(streams)} streams + {long.id}, {', '.join(systems)}")
        tokens = level.info.get("tokens", {})
        for name in systems:
            level.clients[name].stream(streams[0].id, streams[0].prompt, WARMUP_TOKENS, tokens.get(streams[0].id, ()))
        for r in range(rounds):
            for name in mode_order(list(systems), r):
                res = run_scenario(level.clients[name], streams, long, tokens, stream_tokens=stream_tokens,
                                   long_tokens=long_tokens)
                out[name].append(res)
                if log:
                    log(f"scenario {name} round {r + 1}: long TTFT {res.get('long_ttft_s')} s, "
                        f"streams' ITL p99 during its prefill {res.get('window_itl_p99_s')} s")
    finally:
        level.stop()
    keys = ("long_ttft_s", "window_itl_p50_s", "window_itl_p99_s", "window_itl_max_s", "before_itl_p50_s",
            "before_itl_p99_s", "streams_decoding_throughout", "long_prompt_tokens")
    return {"systems": {name: {"median": {k: median(r.get(k) for r in rs) for k in keys}, "rounds": rs}
                        for name, rs in out.items()},
            "streams": [p.id for p in streams], "long_prompt_id": long.id, **_public(level.info)}


def default_threads(threads: int) -> int:
    return threads if threads > 0 else (os.cpu_count() or 1)


def check_fits(tokens: dict[str, list[int]], max_tokens: int, n_ctx: int, headroom: int) -> None:
    """Every prompt + max_tokens + the engine's speculation headroom within the per-request context."""
    for pid, ids in tokens.items():
        if len(ids) + max_tokens + headroom > n_ctx:
            raise BadRequest("n_ctx", f"prompt {pid!r} has {len(ids)} tokens: with max_tokens {max_tokens} and "
                                      f"{headroom} of speculation headroom it needs more than --n-ctx {n_ctx}")


def workdir_default() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix="edgespec-bench-serve-"))
