"""Greedy speculative output against plain output, token by token, by verification width.

Exactness on a CPU rests on batch-invariant kernels (tools/patches): a token's logits are the same
bits whatever else shares its forward. A GPU's kernels are not batch-invariant: a forward of w
tokens (MMVQ up to 8, MMQ above, cuBLAS for wide ones) may sum in another order than a forward of
one, and a near-tie between two tokens can then flip. This counts how often that shows, by width:
each prompt decoded plainly, then with a fixed tree of w - 1 nodes (no controller, no prompt
lookups, no suffix cache), so that every verification forward holds w tokens; each speculative
output is compared with the plain one token by token.

    python -m edgespec.bench.mismatch --suite code --limit 4 --widths 2,4,8,16,32,64 \
        --max-tokens 64 --n-gpu-layers -1 --json m.json --markdown m.md
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from edgespec.session import TREE_EXPAND, TREE_WIDTH
from edgespec.settings import MAX_TREE_DEPTH, MAX_TREE_NODES

WIDTHS = (2, 4, 8, 16, 32, 64)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token sequences differ (a length difference counts at the
    shorter's end); None when they are equal."""
    n = min(len(a), len(b))
    k = next((i for i in range(n) if a[i] != b[i]), n)
    return None if k == n and len(a) == len(b) else k


@dataclass
class WidthCount:
    """One width's comparison with plain decoding over the prompts."""

    width: int
    prompts: int = 0
    diverged: int = 0  # prompts whose speculative output differs from the plain one
    tokens: int = 0  # plain tokens compared
    same_prefix: int = 0  # plain tokens before the first difference, summed
    first_differences: list = field(default_factory=list)  # [prompt] position of the first difference, or None
    verify_forwards: int = 0
    verified_tokens: int = 0  # the root plus the drafted nodes, summed over the verification forwards

    def add(self, plain: Sequence[int], spec: Sequence[int], forwards: int = 0, drafted: int = 0) -> None:
        d = first_difference(plain, spec)
        self.prompts += 1
        self.diverged += d is not None
        self.tokens += len(plain)
        self.same_prefix += len(plain) if d is None else d
        self.first_differences.append(d)
        self.verify_forwards += forwards
        self.verified_tokens += forwards + drafted

    def as_dict(self) -> dict:
        return {"width": self.width, "prompts": self.prompts, "diverged": self.diverged, "tokens": self.tokens,
                "same_prefix": self.same_prefix, "first_differences": self.first_differences,
                "mean_verify_tokens": round(self.verified_tokens / self.verify_forwards, 3)
                if self.verify_forwards else None}


def tree_for_width(width: int) -> tuple[int, int]:
    """(tree_nodes, tree_depth) of a fixed tree verified as `width` tokens: width - 1 nodes, and
    enough levels of the explicit-mode tree (TREE_WIDTH children, TREE_EXPAND expanded a level)
    to grow them."""
    nodes = width - 1
    if not 1 <= nodes <= MAX_TREE_NODES:
        raise ValueError(f"width must be in [2, {MAX_TREE_NODES + 1}], got {width}")
    depth = 1 if nodes <= TREE_WIDTH else 1 + math.ceil((nodes - TREE_WIDTH) / (TREE_WIDTH * TREE_EXPAND))
    return nodes, min(depth, MAX_TREE_DEPTH)


def compare(engine, prompts: Sequence[tuple[int, ...]], widths: Sequence[int], max_tokens: int,
            log=lambda s: None) -> list[WidthCount]:
    """Each prompt (token ids) plainly, then at each width; the counts by width."""
    from edgespec.sampling import SamplingParams
    from edgespec.types import GenerationRequest, SpeculationParams

    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    counts = [WidthCount(w) for w in widths]
    for i, toks in enumerate(prompts):
        plain = engine.generate(GenerationRequest(toks, greedy, SpeculationParams(mode="plain"))).token_ids
        for c in counts:
            nodes, depth = tree_for_width(c.width)
            spec = SpeculationParams(mode="tree", tree_nodes=nodes, tree_depth=depth, ngram=False, suffix=False)
            r = engine.generate(GenerationRequest(toks, greedy, spec))
            c.add(plain, r.token_ids, r.stats.target_forwards, r.stats.drafted_tokens)
        log(f"prompt {i + 1}/{len(prompts)}: " + " ".join(
            f"w{c.width}:{'=' if c.first_differences[-1] is None else c.first_differences[-1]}" for c in counts))
    return counts


def to_markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"Greedy speculative vs plain output, {s['prompts']} prompts x {s['max_tokens']} tokens, "
             f"backend {report.get('backend', '?')}, n_gpu_layers {s['n_gpu_layers']}, flash_attn "
             f"{'on' if s['flash_attn'] else 'off'}",
             "",
             "| verification width | mean verified tokens | prompts diverged "
             "| plain tokens before the first difference |",
             "|---:|---:|---:|---:|"]
    for c in report["widths"]:
        lines.append(f"| {c['width']} | {c['mean_verify_tokens']} | {c['diverged']} / {c['prompts']} | "
                     f"{c['same_prefix']} / {c['tokens']} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="target GGUF (default: the demo F32 target)")
    ap.add_argument("--draft", help="draft GGUF (default: the demo Q8_0 draft)")
    ap.add_argument("--suite", default="structured")
    ap.add_argument("--limit", type=int, default=2, help="first N prompts of each suite file")
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=True,
                    help="off for a CUDA build without its flash-attention kernels (GGML_CUDA_FA=OFF)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    a = ap.parse_args(argv)

    from edgespec.bench.report import machine_info, write_outputs
    from edgespec.bench.runner import bench_engine_config, prompt_tokens
    from edgespec.bench.suite import load_suite
    from edgespec.engine import Engine
    from edgespec.models import default_pair

    widths = [int(w) for w in a.widths.split(",") if w.strip()]
    for w in widths:
        tree_for_width(w)  # a width out of range fails before any model loads
    pair = default_pair()
    cfg = bench_engine_config(a.target or str(pair.target), a.draft or str(pair.draft), n_ctx=a.n_ctx,
                              n_gpu_layers=a.n_gpu_layers, threads=a.threads, flash_attn=a.flash_attn)
    engine = Engine.load(cfg, calibrate=False)  # fixed shapes: no controller, no cost model
    try:
        prompts = load_suite(a.suite, limit=a.limit)
        toks = [prompt_tokens(engine, p) for p in prompts]
        counts = compare(engine, toks, widths, a.max_tokens, log=lambda s: print(s, file=sys.stderr, flush=True))
        backend = engine.model_info().get("backend")
    finally:
        engine.close()
    report = {"settings": {"suite": a.suite, "prompts": len(prompts), "max_tokens": a.max_tokens, "widths": widths,
                           "n_gpu_layers": a.n_gpu_layers, "flash_attn": a.flash_attn, "target": cfg.target.path,
                           "draft": cfg.draft.path if cfg.draft else None},
              "backend": backend, "machine": machine_info(backend), "widths": [c.as_dict() for c in counts]}
    md = to_markdown(report)
    write_outputs(report, md, json_out=a.json, markdown_out=a.markdown)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
