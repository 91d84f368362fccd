#!/usr/bin/env python3
"""Check a `prepare-demo --cost` target against its two claims: the demo target's text, a real
shape's forward cost.

    tools/realistic-check.py --cost 1B [--rounds 5] [--tokens 48] [--threads 2] [--dir /tmp/realistic]
    tools/realistic-check.py --cost 8B --layers 4     # cost only, the first 4 blocks of both

Builds (once, under --dir) the widened target, the demo target requantized to Q4_K_M, and a
random-weight model of the matching real shape (`edgespec models synth`), then prints markdown:
the greedy tokens each pair shares before its first difference on a few prompts, and T(n) for
n = 1..64 of the widened target against the real shape, interleaved round by round in one process
(only the ratios between them mean much on a shared host).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Here is a short story about a robot who learns to paint:",
    "The three laws of thermodynamics are",
    "To make a cup of tea, first",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
]
SIZES = (1, 2, 4, 8, 16, 32, 64)


def _prompt_tokens(path: Path, prompts: list[str]) -> list[list[int]]:
    from edgespec import backend

    m = backend.Model(path)
    try:
        return [m.tokenize(p) for p in prompts]
    finally:
        m.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cost", default="1B")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/realistic"))
    ap.add_argument("--skip-text", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--layers", type=int, default=0, help="cost only: the first N blocks of both models")
    a = ap.parse_args()

    import numpy as np

    from edgespec import backend
    from edgespec.economics import measure
    from edgespec.models import default_pair
    from edgespec.realistic import COSTS, agreement, greedy_tokens, next_token_argmax, prepare_cost_target, widen
    from edgespec.synth import synth

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    a.dir.mkdir(parents=True, exist_ok=True)
    demo = default_pair().target
    shape = COSTS[a.cost][1]
    if a.layers:  # cost only: the first N blocks of both
        widened = a.dir / f"widened-{a.cost}-{a.layers}l.Q4_K_M.gguf"
        if not widened.is_file():
            widen(demo, COSTS[a.cost][0], widened, "q4_k_m", log, layers=a.layers)
        real = a.dir / f"synth-{shape}-{a.layers}l.Q4_K_M.gguf"
        a.skip_text = True
    else:
        widened = prepare_cost_target(a.cost, demo, directory=a.dir, log=log)
        real = a.dir / f"synth-{shape}.Q4_K_M.gguf"
    if not real.is_file():
        synth(shape, "q4_k_m", real, layers=a.layers or None, log=log)
    requant = a.dir / "demo.Q4_K_M.gguf"
    if not requant.is_file():
        backend.quantize(demo, requant, "q4_k_m")

    sizes = {}
    for p in (widened, real, requant):
        m = backend.Model(p)
        sizes[p] = m.size_bytes
        m.close()
    print(f"## `prepare-demo --cost {a.cost}` against `synth --shape {shape} --type q4_k_m`\n")
    print("| file | bytes of weights |\n|---|---:|")
    for p, b in sizes.items():
        print(f"| {p.name} | {b / 1e6:,.1f} MB |")

    if not a.skip_text:
        log("greedy text")
        ref = greedy_tokens(demo, PROMPTS, a.tokens, a.threads or None)
        q = greedy_tokens(requant, PROMPTS, a.tokens, a.threads or None)
        w = greedy_tokens(widened, PROMPTS, a.tokens, a.threads or None)
        print(f"\n{len(PROMPTS)} prompts, {a.tokens} greedy tokens each: tokens shared before the first difference\n")
        print("| pair | shared / compared |\n|---|---:|")
        pairs = (("widened vs demo target F32", w, ref), ("widened vs demo target Q4_K_M", w, q),
                 ("demo Q4_K_M vs demo F32 (quantization alone)", q, ref))
        for name, x, y in pairs:
            s, t = agreement(x, y)
            print(f"| {name} | {s} / {t} |")
        # teacher-forced on the F32 demo's text: each model's next token after every prefix
        seqs = [tok + g for tok, g in zip(_prompt_tokens(demo, PROMPTS), ref)]
        argmax = {p: next_token_argmax(p, seqs, a.threads or None) for p in (demo, requant, widened)}
        print("\nnext-token agreement on the F32 demo's greedy text (teacher-forced, continuation positions)\n")
        print("| pair | same next token |\n|---|---:|")
        for name, mx, my in (("widened vs demo target F32", widened, demo),
                             ("widened vs demo target Q4_K_M", widened, requant),
                             ("demo Q4_K_M vs demo F32", requant, demo)):
            same = total = 0
            for seq, g, rx, ry in zip(seqs, ref, argmax[mx], argmax[my]):
                lo = len(seq) - len(g) - 1  # the row that predicts the first generated token
                same += int(np.sum(rx[lo:-1] == ry[lo:-1]))
                total += len(g)
            print(f"| {name} | {same} / {total} ({same / total:.1%}) |")

    if a.skip_timing:
        return 0
    log("timing")
    tw, tr = measure([(widened, SIZES), (real, SIZES)], context=a.context, rounds=a.rounds, n_targets=2,
                     threads=a.threads or None, log=log)
    print(f"\nT(n), ms, median of {a.rounds} interleaved rounds after {a.context} tokens, "
          f"{a.threads or 'all'} threads\n")
    print("| n | widened | " + shape + " | widened / real | widened T(n)/T(1) | real T(n)/T(1) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in SIZES:
        print(f"| {n} | {tw[n] * 1e3:.1f} | {tr[n] * 1e3:.1f} | {tw[n] / tr[n]:.2f} | {tw[n] / tw[1]:.2f} | "
              f"{tr[n] / tr[1]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
