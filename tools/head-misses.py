#!/usr/bin/env python3
"""Where a head misses: its depth-1 hits on a suite's answers, by the target's confidence.

    tools/head-misses.py HEAD.gguf SUITE [--max-new 64] [--json OUT]

SUITE is a shipped suite's name or a JSONL file of id, category, prompt (as for
`edgespec models eval-head --suite`), or a training work directory's heldout.json. The target
answers each prompt greedily; at every answer position the head drafts one token from the
target's real features through llama.cpp (Eagle3Drafter, as `eval-head` does). Printed, by
category and by the target's top-1 probability at that position: the share of positions, how
often the head's token is the target's, how often the target's token is in the head's draft
vocabulary (a label outside it is a certain miss), and the head's rate where it is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

BUCKETS = ((0.0, 0.5), (0.5, 0.8), (0.8, 0.95), (0.95, 1.01))


def answers(target, suite: str, max_new: int):  # noqa: ANN001, ANN201
    """(sequences, answer starts, categories)."""
    if suite.endswith(".json"):
        d = json.loads(Path(suite).read_text())
        return d["sequences"], d["prompt_len"], ["held-out"] * len(d["sequences"])
    from edgespec.bench.suite import load_suite
    from edgespec.headtrain.evaluate import suite_answers

    prompts = load_suite(suite)
    seqs, starts = suite_answers(target, [p.prompt for p in prompts], max_new)
    return seqs, starts, [p.category for p in prompts]


def records(target, head, d2t: set[int], seqs, starts, cats) -> list[tuple[str, float, int, int]]:  # noqa: ANN001
    """(category, the target's top-1 probability, head right, label in the draft vocabulary) per
    answer position: `evaluate.acceptance`'s walk, a chain of one."""
    from edgespec.headtrain.evaluate import acceptance

    pos: list[tuple[int, float, int, int]] = []
    acceptance(target, head, seqs, starts, depth=1, positions=pos)
    return [(cats[i], p, ok, int(label in d2t)) for i, p, ok, label in pos]


def summary(recs: list[tuple[str, float, int, int]]) -> dict:
    a = np.array([r[1:] for r in recs], float)

    def rate(m):  # noqa: ANN001, ANN202
        return float(a[m, 1].mean()) if m.any() else None

    cats = {}
    for c in sorted({r[0] for r in recs}):
        m = np.array([r[0] == c for r in recs])
        cats[c] = {"positions": int(m.sum()), "depth1": rate(m), "in_draft_vocab": float(a[m, 2].mean()),
                   "target_top1_p": float(a[m, 0].mean())}
    buckets = []
    for lo, hi in BUCKETS:
        m = (a[:, 0] >= lo) & (a[:, 0] < hi)
        buckets.append({"p_from": lo, "p_to": min(hi, 1.0), "share": float(m.mean()), "depth1": rate(m),
                        "in_draft_vocab": float(a[m, 2].mean()) if m.any() else None,
                        "depth1_in_vocab": rate(m & (a[:, 2] > 0))})
    return {"positions": len(recs), "depth1": float(a[:, 1].mean()), "in_draft_vocab": float(a[:, 2].mean()),
            "target_top1_p": float(a[:, 0].mean()), "by_category": cats, "by_target_confidence": buckets}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("head")
    ap.add_argument("suite")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--target", default=None, help="target GGUF (default: the demo target)")
    ap.add_argument("--json", default=None, help="also write the summary here")
    args = ap.parse_args()
    from edgespec.backend import Model
    from edgespec.heads.weights import read_gguf
    from edgespec.models import default_pair

    target = Model(Path(args.target) if args.target else default_pair().target)
    head = Model(Path(args.head))
    d2t = {int(t) for t in read_gguf(Path(args.head)).d2t}
    seqs, starts, cats = answers(target, args.suite, args.max_new)
    s = summary(records(target, head, d2t, seqs, starts, cats))
    s.update(head=args.head, suite=args.suite, max_new=args.max_new)
    print(f"{s['positions']} positions: head right {s['depth1']:.3f}, label in the draft vocabulary "
          f"{s['in_draft_vocab']:.3f}, the target's mean top-1 probability {s['target_top1_p']:.3f}")
    for c, v in s["by_category"].items():
        print(f"  {c:10s} {v['positions']:5d} positions: right {v['depth1']:.3f}, in vocabulary {v['in_draft_vocab']:.3f}, "
              f"top-1 p {v['target_top1_p']:.3f}")
    print("the target's top-1 p | share | head right | in vocabulary | right where in vocabulary")
    for b in s["by_target_confidence"]:
        f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        print(f"  [{b['p_from']:.2f}, {b['p_to']:.2f}) | {b['share']:.3f} | {f(b['depth1'])} | {f(b['in_draft_vocab'])} | "
              f"{f(b['depth1_in_vocab'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
