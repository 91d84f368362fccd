"""Exactness checks against a running daemon (`edgespec selftest --addr HOST:PORT`).

On the site's own hardware, models and configuration: each prompt is decoded greedily in plain
mode, alone, then in every speculative mode (auto, chain, tree), one at a time and several at
once (so the forwards batch requests together and the slots and the shared cache carry
history), and every output must equal the plain one token for token. The prompts can be the
site's own (a bench suite or JSONL file), the stream counts several, and each check repeated,
since what the daemon holds from earlier requests differs each time. On a CPU with the patched
ggml this holds bit for bit; where it does not (a CUDA build, whose kernels depend on the batch
size) the report names the prompt and the first differing position. The statistical checks of
sampling at temperature > 0 need the models' raw distributions and run locally (`edgespec
selftest` without --addr)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

PROMPTS = (
    "Write a Python function that returns the factorial of n.",
    "Extract the name and the city as JSON: Maria Lopez moved to Lisbon in 2019.",
    "Continue the clause: The Supplier shall indemnify the Buyer against",
    "用一句话解释什么是投机解码。",
    "List the steps to reset a forgotten password.",
    "Summarise: the meeting moved from Monday to Thursday because the auditor was ill.",
)
MODES = ("AUTO", "CHAIN", "TREE")


@dataclass
class LiveCheck:
    name: str
    passed: bool
    detail: str = ""


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_live_checks(stub, metadata=(), max_tokens: int = 48, concurrency: int | tuple[int, ...] = 4,
                    timeout: float = 600.0, prompts=PROMPTS, modes: tuple[str, ...] = MODES, repeat: int = 1,
                    progress: Callable[[int], None] | None = None) -> list[LiveCheck]:
    """`stub`: an edgespec.v1 Inference stub on the daemon. Every prompt is first decoded in plain
    mode, alone; then one check per (mode, streams at once, repeat) over all prompts, each output
    compared with plain's token for token. `concurrency`: one level, or several (1 is always
    included); `progress(n)` is told of each n finished requests."""
    from edgespec.proto.edgespec.v1 import inference_pb2 as pb

    def generate(prompt: str, mode: str) -> list[int]:
        req = pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content=prompt)],
            sampling=pb.SamplingOptions(temperature=0.0, max_tokens=max_tokens),
            speculation=pb.SpeculationOptions(mode=pb.SpeculationMode.Value(mode)))
        out = list(stub.Generate(req, timeout=timeout, metadata=metadata).token_ids)
        if progress is not None:
            progress(1)
        return out

    levels = sorted({1, *((concurrency,) if isinstance(concurrency, int) else concurrency)})
    plain = [generate(p, "OFF") for p in prompts]
    checks = []
    for r in range(repeat):
        for mode in modes:
            for together in levels:
                with ThreadPoolExecutor(together) as pool:
                    outs = list(pool.map(lambda p, mode=mode: generate(p, mode), prompts))
                bad = [(i, _first_diff(o, plain[i])) for i, o in enumerate(outs) if o != plain[i]]
                detail = "; ".join(f"prompt {i} differs from token {k}" for i, k in bad)
                suffix = f"_r{r + 1}" if repeat > 1 else ""
                checks.append(LiveCheck(f"greedy_{mode.lower()}_equals_plain_x{together}{suffix}", not bad, detail))
    return checks


def live_requests(n_prompts: int, concurrency: int | tuple[int, ...], modes: tuple[str, ...], repeat: int) -> int:
    """How many requests run_live_checks sends (for a progress bar)."""
    levels = {1, *((concurrency,) if isinstance(concurrency, int) else concurrency)}
    return n_prompts * (1 + repeat * len(modes) * len(levels))
