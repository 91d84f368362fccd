#!/usr/bin/env python3
"""What the suffix cache and the prompt lookups can give a stream of requests at a given price of a
verified token: `tools/suffix-replay.py`.

The target's greedy answers to a suite, in order (decoded once, plainly, four at a time; or read
from --outputs), are replayed through the real drafters (edgespec/drafters/suffix.py's cache,
its learnt acceptance and budget; the n-gram prompt lookup with its learnt reach and budget),
step by step: each step grafts what the budgets buy at `--price` (an extra verified token's
cost in plain-token units: about 0.2-0.3 at four streams on a 2-core CPU, from the online cost
curve), the longest grafted path the target's answer follows is accepted, and the cache learns
and stores as the daemon's does. A step costs 1 + price * grafted tokens; the speed-up over plain
decoding is tokens over cost, by blocks of the stream. The oracle grafts exactly the longest
correct continuation that the cache or a lookup holds: no drafter's choice can do better.

No forward costs, prefill or Python time: the decode-side ceiling of these drafts. Compare it
with `edgespec bench-serve --suite S --suffix-cache` (the real daemon) to see what the rest costs.

    .venv/bin/python tools/suffix-replay.py --suite repetitive --max-tokens 96 --price 0.23
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys

from edgespec.bench.suite import load_suite
from edgespec.drafters.ngram import NgramDrafter, lookup
from edgespec.drafters.suffix import SuffixCache, SuffixDrafter


class Price:
    """The cost model the budgets read: every extra verified token costs `price` plain tokens."""

    def __init__(self, price: float):
        self.price = price

    def extra_seconds(self, base: int, k: int) -> float:
        return self.price * k


def plain_outputs(suite: str, max_tokens: int, limit: int | None) -> list[dict]:
    from edgespec.cli.common import engine_config
    from edgespec.engine import Engine
    from edgespec.types import GenerationRequest, SamplingParams, SpeculationParams

    cfg = dataclasses.replace(engine_config(None, None, parallel=4), prompt_cache=False, suffix_cache=False)
    engine = Engine.load(cfg, calibrate=False)
    prompts = load_suite(suite)[:limit]
    reqs = [(p, GenerationRequest(tuple(engine.encode_chat([("user", p.prompt)])),
                                  SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                  SpeculationParams(mode="plain"))) for p in prompts]
    queue, live, done = list(reqs), {}, {}
    while queue or live:
        while queue and len(live) < 4:
            p, r = queue.pop(0)
            live[engine.open_session(r)] = (p, r)
        engine.tick(list(live))
        for s in [s for s in live if s.done]:
            p, r = live.pop(s)
            done[p.id] = {"id": p.id, "category": p.category, "prompt": list(r.prompt_tokens),
                          "output": s.result().token_ids}
            s.close()
            print(f"\r{len(done)}/{len(reqs)} answers", end="", file=sys.stderr)
    print(file=sys.stderr)
    engine.close()
    return [done[p.id] for p, _ in reqs]


def followed(paths: list[list[int]], rest: list[int]) -> int:
    """The longest of `paths` that `rest` starts with."""
    return max((len(p) for p in paths if rest[:len(p)] == p), default=0)


def replay(stream: list[dict], price: float, oracle: bool) -> list[tuple[str, int, float, float]]:
    """(category, index, tokens, cost) per request."""
    cache, cost_model = SuffixCache(), Price(price)
    rows = []
    for idx, r in enumerate(stream):
        prompt, out = r["prompt"], r["output"]
        suffix, ngram = SuffixDrafter(cache), NgramDrafter()
        pos, cost = 0, 0.0
        while pos < len(out):
            ctx, rest = prompt + out[:pos], out[pos:]
            prop = suffix.look(ctx)
            lk, kind = ngram.look(ctx)
            if oracle:
                paths = prop.paths() + [lk[:j] for j in range(1, len(lk) + 1)]
                acc = followed(paths, rest)
                grafted = acc
            else:
                kl = min(ngram.budget(kind, cost_model, 1, 1.0), len(lk))
                ks = suffix.budget(prop, cost_model, 1 + kl, 1.0)
                lookups = [lk[:j] for j in range(1, kl + 1)]
                tree = prop.paths(ks)
                acc = followed(lookups + tree, rest)
                grafted = kl + sum(1 for p in tree if p not in lookups)
            pos += min(acc + 1, len(rest))
            cost += 1.0 + price * grafted
            suffix.score(prompt + out[:pos])
            ngram.score(prompt + out[:pos])
        cache.insert("", prompt, out)
        rows.append((r["category"], idx, float(len(out)), cost))
    return rows


def table(rows, blocks: list[int]) -> dict[str, float]:
    out = {}
    for lo, hi in zip(blocks, blocks[1:] + [10 ** 9]):
        sel = [r for r in rows if lo <= r[1] < hi]
        if sel:
            out[f"{lo}-{min(hi, len(rows)) - 1}"] = sum(r[2] for r in sel) / sum(r[3] for r in sel)
    by = collections.defaultdict(lambda: [0.0, 0.0])
    for cat, idx, tok, cost in rows:
        if idx >= 30:
            by[cat][0] += tok
            by[cat][1] += cost
    out.update({f"{cat} (after 30)": t / c for cat, (t, c) in sorted(by.items())})
    out["all"] = sum(r[2] for r in rows) / sum(r[3] for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="repetitive")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--price", type=float, action="append", help="an extra verified token in plain tokens (repeatable)")
    ap.add_argument("--outputs", help="read (or, when missing, write) the plain answers here (JSON)")
    a = ap.parse_args()
    try:
        stream = json.load(open(a.outputs)) if a.outputs else None
    except FileNotFoundError:
        stream = None
    if stream is None:
        stream = plain_outputs(a.suite, a.max_tokens, a.limit)
        if a.outputs:
            json.dump(stream, open(a.outputs, "w"))
    blocks = [0, 10, 30, 100]
    print(f"{len(stream)} requests, {sum(len(r['output']) for r in stream)} answer tokens; speed-up over plain decoding:")
    for price in a.price or [0.23]:
        for name, oracle in (("budgets", False), ("oracle", True)):
            t = table(replay(stream, price, oracle), blocks)
            print(f"price {price:.2f} {name:8s} " + "  ".join(f"{k} {v:.2f}" for k, v in t.items()))


if __name__ == "__main__":
    main()
