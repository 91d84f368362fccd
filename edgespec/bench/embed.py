"""Embedding throughput: inputs per second at N concurrent callers, each sending one input per
request to POST /v1/embeddings, against edgespec and llama-server `--embeddings` on the same
GGUF, the same threads, loopback. The systems alternate within each round, so drift of a shared
box falls on both alike.

Used by `edgespec bench-embed` (edgespec/cli/bench_embed.py)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

WORDS = ("river", "ledger", "invoice", "harbour", "protein", "compiler", "orchard", "glacier", "tariff", "violin",
         "satellite", "mortgage", "enzyme", "lantern", "quarry", "pension", "cathedral", "algorithm")


def inputs(n: int, words: int = 24) -> list[str]:
    """n distinct sentences of about `words` words (deterministic)."""
    out = []
    for i in range(n):
        ws = [WORDS[(i * 7 + j * 5 + j * j) % len(WORDS)] for j in range(words)]
        out.append(f"Note {i}: " + " ".join(ws) + ".")
    return out


@dataclass
class Level:
    system: str
    callers: int
    inputs_per_second: list[float] = field(default_factory=list)  # one per round

    @property
    def median(self) -> float:
        return statistics.median(self.inputs_per_second) if self.inputs_per_second else 0.0


def run_level(base: str, model: str, callers: int, texts: Sequence[str], timeout: float = 300.0) -> float:
    """Inputs per second: `callers` threads share `texts`, one input per request."""
    import httpx

    lock = threading.Lock()
    queue = list(texts)
    errors: list[str] = []

    def caller() -> None:
        with httpx.Client(base_url=base, timeout=timeout) as c:
            while True:
                with lock:
                    if not queue:
                        return
                    text = queue.pop()
                r = c.post("/v1/embeddings", json={"model": model, "input": text})
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
                    return

    threads = [threading.Thread(target=caller) for _ in range(callers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{base}: {errors[0]}")
    return len(texts) / seconds


def bench(systems: dict[str, tuple[str, str]], *, callers: Sequence[int], requests: int, rounds: int,
          words: int = 24) -> list[Level]:
    """systems: name -> (base URL, model name). Each round runs every level of every system
    (systems alternate); each level embeds `requests` inputs."""
    texts = inputs(requests, words)
    levels = {(s, n): Level(s, n) for n in callers for s in systems}
    for base, model in systems.values():  # warm-up: the contexts are made, the caches touched
        run_level(base, model, 1, texts[:4])
    for r in range(rounds):
        order = list(systems) if r % 2 == 0 else list(reversed(systems))
        for n in callers:
            for s in order:
                base, model = systems[s]
                levels[(s, n)].inputs_per_second.append(run_level(base, model, n, texts))
    return list(levels.values())


def report(levels: Sequence[Level], meta: dict) -> tuple[dict, str]:
    """(JSON, markdown) of a run."""
    by = {(lv.system, lv.callers): lv for lv in levels}
    systems = list(dict.fromkeys(lv.system for lv in levels))
    callers = sorted({lv.callers for lv in levels})
    lines = ["| callers | " + " | ".join(f"{s} inputs/s" for s in systems) + " | ratio |",
             "| --- | " + " | ".join("---" for _ in systems) + " | --- |"]
    for n in callers:
        meds = [by[(s, n)].median for s in systems]
        ratio = f"{meds[0] / meds[1]:.2f}x" if len(meds) > 1 and meds[1] else "-"
        lines.append(f"| {n} | " + " | ".join(f"{m:.1f}" for m in meds) + f" | {ratio} |")
    md = "\n".join(lines) + "\n"
    data = {"meta": meta, "levels": [{**asdict(lv), "median": lv.median} for lv in levels]}
    return data, md
