"""Exactness checks against a running daemon (`edgespec selftest --addr HOST:PORT`).

On the site's own hardware, models and configuration: each prompt is decoded greedily in plain
mode, alone, then in every speculative mode (auto, chain, tree), one at a time and several at
once (so the forwards batch requests together and the slots and the shared cache carry
history), and every output must equal the plain one token for token. On a CPU with the patched
ggml this holds bit for bit; where it does not (a CUDA build, whose kernels depend on the batch
size) the report names the prompt and the first differing position. The statistical checks of
sampling at temperature > 0 need the models' raw distributions and run locally (`edgespec
selftest` without --addr)."""

from __future__ import annotations

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


def run_live_checks(stub, metadata=(), max_tokens: int = 48, concurrency: int = 4, timeout: float = 600.0,
                    prompts=PROMPTS) -> list[LiveCheck]:
    """`stub`: an edgespec.v1 Inference stub on the daemon. One check per (mode, one-at-a-time |
    concurrent) over all prompts."""
    from edgespec.proto.edgespec.v1 import inference_pb2 as pb

    def generate(prompt: str, mode: str) -> list[int]:
        req = pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content=prompt)],
            sampling=pb.SamplingOptions(temperature=0.0, max_tokens=max_tokens),
            speculation=pb.SpeculationOptions(mode=pb.SpeculationMode.Value(mode)))
        return list(stub.Generate(req, timeout=timeout, metadata=metadata).token_ids)

    plain = [generate(p, "OFF") for p in prompts]
    checks = []
    for mode in MODES:
        for together in (1, concurrency):
            with ThreadPoolExecutor(together) as pool:
                outs = list(pool.map(lambda p: generate(p, mode), prompts))
            bad = [(i, _first_diff(o, plain[i])) for i, o in enumerate(outs) if o != plain[i]]
            detail = "; ".join(f"prompt {i} differs from token {k}" for i, k in bad)
            checks.append(LiveCheck(f"greedy_{mode.lower()}_equals_plain_x{together}", not bad, detail))
    return checks
