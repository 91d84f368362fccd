#!/usr/bin/env python3
"""Fill docs/benchmarks/README.md's results sections from docs/benchmarks/results/*.json|md
(written by tools/run-benchmarks.sh), so the page always quotes the committed run."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from edgespec.bench.report import ceiling, plain_forward_seconds  # noqa: E402  (pure: no llama.cpp)
from edgespec.bench.runner import Row  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs/benchmarks"
R = DOCS / "results"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def table(name: str) -> str:
    text = (R / name).read_text()
    return text[text.index("| category"):].replace("## ", "#### ").strip()


def bound(d: dict) -> dict:
    """The report's ceiling, over the run's own plain forwards (edgespec.bench.report.ceiling)."""
    rows = [Row(**{**r, "accepted_per_depth": tuple(r.get("accepted_per_depth", ()))}) for r in d["results"]]
    return ceiling(d["costs"], plain_seconds=plain_forward_seconds(rows))


def speedup(d: dict, cat: str, mode: str) -> float:
    return d["summary"][cat][mode]["speedup"]


def rate(d: dict, mode: str) -> float:
    """tokens / seconds of a mode over the structured categories."""
    # the categories the bench's headline pooled (older reports: the shipped four)
    names = d.get("headline", {}).get("structured_categories") or ("code", "json", "legal", "rag")
    cats = [c for c in names if c in d["summary"]]
    return sum(d["summary"][c][mode]["tokens"] for c in cats) / sum(d["summary"][c][mode]["seconds"] for c in cats)


def structured(d: dict, mode: str) -> float:
    """tokens / seconds over the structured categories, over plain's."""
    return rate(d, mode) / rate(d, "plain")


def main() -> None:
    f32, q8, rd, sampled = (json.loads((R / f).read_text())
                            for f in ("f32.json", "q8.json", "random-draft.json", "sampled.json"))
    # llama.cpp's speculation with the other draft (Q4_0), interleaved with edgespec's auto
    q4_draft = json.loads((R / "f32-llama-q4-draft.json").read_text())
    auto_over_q4_anchor = q4_draft["headline"]["auto_over_llama_cpp_speculative"]
    h = f32["headline"]
    # the second run of the structured suites (tools/run-benchmarks.sh, step 2b)
    run2 = json.loads((R / "f32-run2.json").read_text())

    def both(fn) -> str:
        return f"{fn(f32)} / {fn(run2)}"

    def best(d: dict) -> str:
        m = max(("chain", "tree", "auto"), key=lambda m: structured(d, m))
        return f"{structured(d, m):.2f}x ({m})"

    def plain_rate(d: dict) -> str:
        return f"{rate(d, 'plain'):.1f}"

    rows = [
        ("structured prompts: plain tok/s (the machine's state)", "–", both(plain_rate)),
        ("structured prompts (code, json, legal, rag): best mode over plain", ">= 1.5x", both(best)),
        ("structured prompts: auto over plain (issue 3)", ">= 1.4x", both(lambda d: f"{structured(d, 'auto'):.2f}x")),
        ("structured prompts: auto over the best fixed mode", ">= 0.95x",
         both(lambda d: f"{structured(d, 'auto') / max(structured(d, m) for m in ('chain', 'tree')):.2f}x")),
        ("structured prompts: tree tau (16 nodes, 6 deep)", ">= 4.5",
         both(lambda d: f"{d['headline']['structured_tree_tau']:.2f}")),
        ("tree tau over chain tau (all prompts)", ">= 1.3x",
         f"{f32['summary']['overall']['tree']['tau'] / f32['summary']['overall']['chain']['tau']:.2f}x"),
        ("drift prompts: auto over plain", ">= 0.95x", f"{speedup(f32, 'drift', 'auto'):.2f}x"),
        ("all prompts: auto over plain", "(never lose)", f"{speedup(f32, 'overall', 'auto'):.2f}x"),
        ("useless (random-weights) draft: auto over plain, all suites", ">= 0.95x",
         f"{speedup(rd, 'overall', 'auto'):.2f}x"),
        ("edgespec auto over `llama-speculative-simple`", ">= 1.25x", f"{h['auto_over_llama_cpp_speculative']:.2f}x"),
        ("edgespec auto over `llama-speculative-simple` with the Q4_0 draft (structured)", ">= 1.25x (either draft)",
         f"{auto_over_q4_anchor:.2f}x"),
        ("edgespec plain over `llama-completion`", "(sanity: ~1.0x)", f"{h['plain_over_llama_cpp_plain']:.2f}x"),
        ("Q8_0 target: auto over plain (structured)", "~1.0x (must not lose)", f"{speedup(q8, 'overall', 'auto'):.2f}x"),
        ("sampled (temperature 0.7, top_p 0.95): auto over plain, all suites / structured", "(never lose)",
         f"{speedup(sampled, 'overall', 'auto'):.2f}x / {structured(sampled, 'auto'):.2f}x"),
        ("bound: a draft always right, chain of 4 (from the run's forward costs)", "(ceiling)",
         both(lambda d: f"{bound(d)['chain']['4']['perfect_draft']:.2f}x "
                        f"(any chain {bound(d)['best_perfect_draft']:.2f}x)")),
    ]
    goals = "\n".join(["| goal | target | measured (run 1 / run 2 where two) |", "|---|---|---|"]
                      + [f"| {a} | {b} | {c} |" for a, b, c in rows])
    body = f"""{START}
## Results: F32 target + Q8_0 draft ({f32['settings']['prompts']} prompts, {f32['settings']['max_tokens']} tokens each)

{table('f32.md')}

![F32 target](results/f32.png)

### Second run, structured suites (same code, minutes later)

{table('f32-run2.md')}

### llama.cpp's speculation with the Q4_0 draft (structured suites, interleaved with edgespec's auto)

{table('f32-llama-q4-draft.md')}

## Results: Q8_0 target + Q4_0 draft (structured suites)

{table('q8.md')}

![Q8_0 target](results/q8.png)

## Results: useless draft (random weights, same vocabulary)

{table('random-draft.md')}

## Results: sampled decoding (temperature 0.7, top_p 0.95; 3 prompts per suite)

{table('sampled.md')}

![sampled](results/sampled.png)

## Headline (honest)

{goals}
{END}"""
    page = (DOCS / "README.md").read_text()
    if START in page:
        page = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: body, page, flags=re.S)
    else:
        page = page.rstrip() + "\n\n" + body + "\n"
    (DOCS / "README.md").write_text(page)
    print("\n".join(f"{a}: {c} (goal {b})" for a, b, c in rows))


if __name__ == "__main__":
    sys.exit(main())
