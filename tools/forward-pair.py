#!/usr/bin/env python3
"""Two llama.cpp builds, forward for forward: the cost of one target forward of W tokens.

    tools/forward-pair.py LIB_A LIB_B [--widths 1,2,4,16] [--rounds 60] [--threads 2]
    tools/forward-pair.py LIB_A LIB_B --prompt 2800 [--rounds 8]

LIB_A and LIB_B are folders holding a build's libllama.so / libggml*.so (a wheel's
`llama_cpp/lib`, or a build tree's `bin`). Each runs in its own resident process with the demo F32
target loaded and a 200-token context; the two take turns, one forward each (A B, then B A), so
the host's minute-to-minute speed falls on both alike. Prints, per width, each side's median ms
and the median of the per-pair ratios B/A with its quartiles: only the ratio means anything.
An A/A run (the same folder twice) shows the host's noise floor.

`--prompt N` times prompt reading instead: each turn clears the cache and reads an N-token
prompt in whole `n_batch` (512) pieces, as the engine does for a lone request (time to first
token, less the one-token forward and the client).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = Path.home() / ".local/share/edgespec/models/SmolLM2-135M-Instruct.F32.gguf"


def prompt_worker(model: str, threads: int, n: int) -> None:
    from edgespec import backend
    from edgespec.config import ModelConfig

    m = backend.Model(model)
    ctx = backend.Context(m, ModelConfig(model, n_ctx=n + 64, n_batch=512, threads=threads))
    text = "Section 4.2. The supplier shall keep every record of the audit for seven years. " * (n // 8)
    prompt = m.tokenize(text)[:n]
    if len(prompt) < n:
        raise SystemExit(f"the prompt text gives {len(prompt)} tokens, not {n}")
    print("ready", flush=True)
    for _line in sys.stdin:
        ctx.clear()
        t0 = time.perf_counter()
        ctx.decode_rows(prompt, list(range(n)), [[0]] * n, [False] * (n - 1) + [True])
        print(f"{(time.perf_counter() - t0) * 1e3:.4f}", flush=True)


def worker(model: str, threads: int, context: int) -> None:
    from edgespec import backend
    from edgespec.config import ModelConfig

    m = backend.Model(model)
    ctx = backend.Context(m, ModelConfig(model, n_ctx=1024, n_batch=256, threads=threads))
    prompt = m.tokenize("The quick brown fox jumps over the lazy dog. " * 60)[:context]
    p = len(prompt)
    ctx.decode(prompt, list(range(p)), [[0]] * p, [False] * (p - 1) + [True])
    print("ready", flush=True)
    for line in sys.stdin:
        w = int(line)
        toks = (prompt * 4)[:w]
        t0 = time.perf_counter()
        ctx.decode(toks, list(range(p, p + w)), [[0]] * w, [True] * w)
        dt = time.perf_counter() - t0
        ctx.seq_rm(0, p, -1)
        print(f"{dt * 1e3:.4f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lib_a")
    ap.add_argument("lib_b")
    ap.add_argument("--widths", default="1,2,4,16")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--prompt", type=int, default=0, metavar="N",
                    help="time reading an N-token prompt (whole n_batch pieces) instead of forwards at --widths")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        if args.prompt:
            prompt_worker(args.model, args.threads, args.prompt)
        else:
            worker(args.model, args.threads, args.context)
        return 0
    widths = [args.prompt] if args.prompt else [int(w) for w in args.widths.split(",")]
    if not args.prompt and max(widths) + args.context > 1024:
        ap.error("--context plus the widest forward must fit the 1024-cell context")

    def spawn(lib: str) -> subprocess.Popen:
        lib = str(Path(lib).resolve())
        # LD_LIBRARY_PATH too: a build tree's libllama has a RUNPATH to its own ggml libraries
        env = dict(os.environ, LLAMA_CPP_LIB_PATH=lib, LD_LIBRARY_PATH=lib)
        p = subprocess.Popen([sys.executable, __file__, "--worker", "--model", args.model, "--threads",
                              str(args.threads), "--context", str(args.context), "--prompt", str(args.prompt), lib, lib],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if p.stdout.readline().strip() != "ready":
            raise SystemExit(f"the worker on {lib} did not start")
        return p

    a, b = spawn(args.lib_a), spawn(args.lib_b)

    def forward(p: subprocess.Popen, w: int) -> float:
        p.stdin.write(f"{w}\n")
        p.stdin.flush()
        return float(p.stdout.readline())

    ms: dict[int, tuple[list[float], list[float]]] = {w: ([], []) for w in widths}
    warm = 2
    for r in range(args.rounds + warm):
        for w in widths:
            got = {}
            for p in ((a, b) if r % 2 == 0 else (b, a)):
                time.sleep(0.01)  # the other side's threads stop spinning
                got[id(p)] = forward(p, w)
            if r >= warm:
                ms[w][0].append(got[id(a)])
                ms[w][1].append(got[id(b)])
        print(f"\rround {r + 1}/{args.rounds + warm}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for p in (a, b):
        p.stdin.close()
        p.wait()
    print(f"| tokens | A ms | B ms | B/A (median of pairs) | quartiles |")
    print(f"|---:|---:|---:|---:|---|")
    for w in widths:
        xa, xb = ms[w]
        ratios = [y / x for x, y in zip(xa, xb)]
        q = statistics.quantiles(ratios, n=4)
        print(f"| {w} | {statistics.median(xa):.2f} | {statistics.median(xb):.2f} | "
              f"{statistics.median(ratios):.3f} | {q[0]:.3f}-{q[2]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
