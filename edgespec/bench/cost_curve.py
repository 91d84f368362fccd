"""T(n): seconds of a target forward of n tokens, for a few models side by side, with steady
shapes and with shapes alternating with one-token calls.

On a GPU the two differ: llama.cpp replays a forward as a CUDA graph once two identical calls have
warmed it, so a verification width that repeats ("steady": each timed forward follows two untimed
ones of its own size) costs what its kernels cost, while one that follows a one-token forward
every time ("alternate": as a target that verifies between plain steps or draft forwards) pays
the graph's rebuild. The models and sizes take turns within every round (edgespec.economics.measure).

    python -m edgespec.bench.cost_curve --model widened=W.gguf --model synth=S.gguf --sizes 1-64 \
        --n-gpu-layers -1 --json t.json --markdown t.md
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

SHAPES = ("steady", "alternate")
STEADY_REPEAT = 2  # untimed same-size forwards before each timed one: a CUDA graph warmed


def parse_sizes(text: str) -> list[int]:
    """"1-8,16,32" -> [1, ..., 8, 16, 32]."""
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if not 1 <= a <= b:
            raise ValueError(f"sizes: {part!r} is not n or lo-hi with 1 <= lo <= hi")
        out.update(range(a, b + 1))
    if not out:
        raise ValueError("sizes: none given")
    return sorted(out)


def measure_curves(models: Sequence[tuple[str, Path]], sizes: Sequence[int], shapes: Sequence[str], *,
                   rounds: int, context: int, n_gpu_layers: int, flash_attn: bool, threads: int | None,
                   log=lambda s: None) -> dict:
    """{shape: {label: {n: seconds}}}."""
    from edgespec.economics import measure

    out: dict[str, dict[str, dict[int, float]]] = {}
    for shape in shapes:
        if shape not in SHAPES:
            raise ValueError(f"shapes: {shape!r} is not one of {', '.join(SHAPES)}")
        log(f"{shape} shapes")
        tables = measure([(p, sizes) for _, p in models], context=context, rounds=rounds, threads=threads,
                         n_gpu_layers=n_gpu_layers, alternate=shape == "alternate",
                         repeat=STEADY_REPEAT if shape == "steady" else 0, n_targets=len(models),
                         flash_attn=flash_attn, log=log)
        out[shape] = {label: t for (label, _), t in zip(models, tables)}
    return out


def to_markdown(report: dict) -> str:
    s = report["settings"]
    curves = report["curves"]
    lines = [f"T(n), ms, median of {s['rounds']} interleaved rounds after {s['context']} tokens of context, "
             f"n_gpu_layers {s['n_gpu_layers']}, flash_attn {'on' if s['flash_attn'] else 'off'}", ""]
    cols = [(shape, label) for shape in curves for label in curves[shape]]
    lines.append("| n | " + " | ".join(f"{label}, {shape}" for shape, label in cols) + " | "
                 + " | ".join(f"{label}, {shape}, T(n)/T(1)" for shape, label in cols) + " |")
    lines.append("|---:|" + "---:|" * (2 * len(cols)))
    for n in s["sizes"]:
        ms = [curves[shape][label][str(n)] * 1e3 for shape, label in cols]
        rel = [curves[shape][label][str(n)] / curves[shape][label][str(s["sizes"][0])] for shape, label in cols]
        lines.append(f"| {n} | " + " | ".join(f"{x:.2f}" for x in ms + rel) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="LABEL=PATH (repeat for each model)")
    ap.add_argument("--sizes", default="1-64", help="n values: 1-64, or 1,2,4,8")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=True,
                    help="off for a CUDA build without its flash-attention kernels (GGML_CUDA_FA=OFF)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    a = ap.parse_args(argv)
    models = []
    for m in a.model:
        label, sep, path = m.partition("=")
        if not sep or not Path(path).is_file():
            ap.error(f"--model {m!r}: want LABEL=PATH of an existing GGUF")
        models.append((label, Path(path)))
    sizes = parse_sizes(a.sizes)
    shapes = [x.strip() for x in a.shapes.split(",") if x.strip()]

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    curves = measure_curves(models, sizes, shapes, rounds=a.rounds, context=a.context, n_gpu_layers=a.n_gpu_layers,
                            flash_attn=a.flash_attn, threads=a.threads or None, log=log)
    from edgespec.bench.report import machine_info, write_outputs

    report = {"settings": {"models": {label: str(p) for label, p in models}, "sizes": sizes, "shapes": shapes,
                           "rounds": a.rounds, "context": a.context, "n_gpu_layers": a.n_gpu_layers,
                           "flash_attn": a.flash_attn, "steady_repeat": STEADY_REPEAT},
              "machine": machine_info(),
              "curves": {shape: {label: {str(n): t for n, t in table.items()} for label, table in by.items()}
                         for shape, by in curves.items()}}
    md = to_markdown(report)
    write_outputs(report, md, json_out=a.json, markdown_out=a.markdown)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
