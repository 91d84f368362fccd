"""The generated suites are what their generators write: `python -m edgespec.bench.suites_long`
and `... suites_repetitive` reproduce the shipped files line for line, so an edit to either side
alone fails here."""

from __future__ import annotations

import json

import pytest

from edgespec.bench import suites_long, suites_repetitive
from edgespec.bench.suite import load_suite


@pytest.mark.parametrize("gen", [suites_long, suites_repetitive], ids=["long", "repetitive"])
def test_a_generator_reproduces_its_shipped_suite(gen, tmp_path):
    shipped = gen.OUT.read_text(encoding="utf-8")
    assert [json.loads(ln) for ln in shipped.splitlines()] == gen.lines() == gen.lines()  # seeded afresh each call
    gen.main(tmp_path / "suite.jsonl")
    assert (tmp_path / "suite.jsonl").read_text(encoding="utf-8") == shipped
    assert len(load_suite(str(tmp_path / "suite.jsonl"))) == len(gen.lines())
