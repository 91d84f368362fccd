"""Wide prompts (edgespec/headtrain/wide.py): real material from installed packages in the six
categories, deterministic in the seed, distinct, never a benchmark suite's prompt."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from edgespec.headtrain.prompts import CATEGORIES
from edgespec.headtrain.wide import _functions, _paragraphs, wide_prompts


def test_wide_prompts_are_balanced_distinct_deterministic_and_not_the_benchmarks():
    ps = wide_prompts(60, seed=0)
    assert ps == wide_prompts(60, seed=0) and ps != wide_prompts(60, seed=1)
    assert Counter(c for c, _ in ps) == dict.fromkeys(CATEGORIES, 10)
    assert [c for c, _ in ps[:6]] == list(CATEGORIES)  # round-robin: every prefix is balanced
    assert len({p for _, p in ps}) == 60
    code = [p for c, p in ps if c == "code"]
    assert all("def " in p for p in code)
    assert all(any("\u4e00" <= ch <= "\u9fff" for ch in p) for c, p in ps if c == "chinese")
    suites = Path(__file__).resolve().parents[2] / "edgespec" / "bench" / "suites"
    rows = [json.loads(ln) for f in suites.glob("*.jsonl") for ln in f.read_text().splitlines() if ln.strip()]
    bench = {r.get("prompt", r.get("query")) for r in rows}  # the generation suites' prompts, rerank.jsonl's queries
    assert not bench & {p for _, p in ps}
    assert not {p for _, p in wide_prompts(12, seed=0, exclude=[p for _, p in ps[:6]])} & {p for _, p in ps[:6]}


def test_material_is_cut_where_a_reader_would():
    src = "import os\n\ndef add(a, b):\n    # sum\n    c = a + b\n    return c\n\nx = 1\n\ndef tiny():\n    pass\n"
    assert list(_functions(src)) == ["def add(a, b):\n    # sum\n    c = a + b\n    return c"]  # tiny(): too short
    prose = " ".join(["word"] * 30)
    text = f"{prose}\n\n    indented code block\n    more\n\n>>> a doctest\n\nshort\n\n{prose}."
    assert list(_paragraphs(text)) == [prose, prose + "."]


def test_a_category_whose_material_is_missing_drops_out(monkeypatch):
    """Packages with documentation but no Python functions or licences: code, JSON (it draws on
    sentences and signatures) and legal prompts are not made; the rest still are."""
    from edgespec.headtrain import wide

    prose = " ".join(f"Word{i} is explained here in detail." for i in range(6))
    monkeypatch.setattr(wide, "package_files", lambda **kw: iter([("README.md", prose + "\n\n" + prose.upper())]))
    ps = wide.wide_prompts(9, seed=0)
    assert [c for c, _ in ps[:3]] == ["rag", "chat", "chinese"] and len(ps) == 9
