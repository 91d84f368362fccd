#!/usr/bin/env python3
"""The head trainer's optimisation step, rows per second: the first trainer against this one.

    tools/train-step-bench.py [--rounds 5] [--cases first,f32,bf16] [--json OUT]
    tools/train-step-bench.py --cases first,bf16@HEAD,bf16      # a change against the last commit

Each case runs in a process of its own (compile, three warm steps, then twelve timed ones) and
the cases take turns round by round, so the host's minute-to-minute speed falls on all alike;
only the per-round ratios to `first` mean anything. The demo target's embeddings, a draft
vocabulary of 4096, three training-time-test steps, random features and labels (the step's cost
does not depend on the values):

- `first`: the trainer as first committed (`git show 389c074:edgespec/heads/model_jax.py`):
  float32, 8 windows of 128 rows, a log-softmax loss, glibc's default heap;
- `f32`, `bf16`: this trainer as `edgespec models train-head` runs it (`keep_training_heap`, 4 packed
  windows of 256 rows, `--precision f32` or `bf16`);
- `f32@REF`, `bf16@REF`: the same, with `edgespec/headtrain/model_jax.py` as committed at git REF.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST = "389c074"  # the commit that added the trainer
MODEL = Path.home() / ".local/share/edgespec/models/SmolLM2-135M-Instruct.F32.gguf"
V, TTT, STEPS = 4096, 3, 12


def one(case: str, src: str | None) -> float:
    """Rows per second of `case`'s step, in this process (`src`: the model_jax.py of `first` or
    of `PRECISION@REF`)."""
    if case != "first":
        from edgespec.heap import keep_training_heap

        keep_training_heap()
    import jax.numpy as jnp
    import numpy as np

    from edgespec.heads.weights import HeadWeights, config_for_target
    from edgespec.headtrain.train import target_embeddings

    cfg = config_for_target(MODEL, V)
    rng = np.random.default_rng(0)
    embed = target_embeddings(MODEL)
    p = {k: jnp.asarray(v) for k, v in HeadWeights.init(cfg, np.arange(V), rng, embed=embed).w.items()}
    embed = jnp.asarray(embed)
    if src:
        spec = importlib.util.spec_from_file_location("model_jax_other", src)
        mj = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mj)
    else:
        from edgespec.headtrain import model_jax as mj
    if case == "first":
        B, W, step = 8, 128, mj.make_train_step(cfg, TTT)
        extra: tuple = ()
    else:
        B, W, step = 4, 256, mj.make_train_step(cfg, TTT, packed=True, precision=case.split("@")[0])
        extra = (jnp.asarray(np.repeat(np.arange(4), W // 4)[None].repeat(B, 0).astype(np.int32)),)
    feats = jnp.asarray(rng.standard_normal((B, W, 3 * cfg.n_embd)).astype(np.float32))
    tok = jnp.asarray(rng.integers(0, embed.shape[0], (B, W)).astype(np.int32))
    lab = jnp.asarray(rng.integers(-1, V, (B, W)).astype(np.int32))
    opt = mj.adam_init(p)
    lr = jnp.float32(1e-3)
    for _ in range(3):
        p, opt, loss, _ = step(p, opt, embed, feats, tok, lab, lr, *extra)
    loss.block_until_ready()
    t = time.perf_counter()
    for _ in range(STEPS):
        p, opt, loss, _ = step(p, opt, embed, feats, tok, lab, lr, *extra)
    loss.block_until_ready()
    return STEPS * B * W / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", default="first,f32,bf16")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: this case only
    ap.add_argument("--src", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(f"ROWS {one(a.one, a.src):.1f}")
        return
    cases = a.cases.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        srcs: dict[str, list[str]] = {}
        for c in cases:
            ref = FIRST if c == "first" else c.partition("@")[2]
            if ref:
                src = Path(tmp) / f"model_jax_{len(srcs)}.py"
                src.write_text(subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:edgespec/heads/model_jax.py"],
                                              capture_output=True, text=True, check=True).stdout)
                srcs[c] = ["--src", str(src)]
        rows: dict[str, list[float]] = {c: [] for c in cases}
        for r in range(a.rounds):
            for c in cases:
                out = subprocess.run([sys.executable, __file__, "--one", c, *srcs.get(c, [])],
                                     capture_output=True, text=True, cwd=ROOT)
                if out.returncode != 0:
                    sys.exit(f"{c}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
                rows[c].append(float(out.stdout.split("ROWS")[1]))
            print(f"round {r + 1}: " + ", ".join(f"{c} {rows[c][-1]:.0f}" for c in cases), flush=True)
    base = rows.get("first")
    result = {}
    for c in cases:
        ratios = [x / b for x, b in zip(rows[c], base)] if base else []
        result[c] = {"rows_per_s": rows[c], "median": statistics.median(rows[c]),
                     "ratio_to_first": [round(x, 3) for x in ratios],
                     "ratio_to_first_median": round(statistics.median(ratios), 3) if ratios else None}
        print(f"{c}: median {result[c]['median']:.0f} rows/s"
              + (f", x{result[c]['ratio_to_first_median']:.2f} the first trainer (per round: "
                 + " ".join(f"{x:.2f}" for x in ratios) + ")" if ratios else ""))
    if a.json:
        a.json.write_text(json.dumps({"rounds": a.rounds, "draft_vocab": V, "ttt_steps": TTT, "cases": result},
                                     indent=2) + "\n")


if __name__ == "__main__":
    main()
