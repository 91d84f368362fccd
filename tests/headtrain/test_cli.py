"""`edgespec models train-head` / `head-cost`: bad input is one line naming the value, exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

EDGESPEC = [sys.executable, "-m", "edgespec.cli.main", "models"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*EDGESPEC, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("args", "needle"), [
    (["train-head", "/tmp/h.gguf", "--target", "/nonexistent/t.gguf"], "/nonexistent/t.gguf"),
    (["train-head", "/tmp/h.gguf", "--target", sys.executable, "--minutes", "0"], "--minutes"),
    (["train-head", "/tmp/h.gguf", "--target", sys.executable, "--precision", "fp8"], "--precision"),
    (["train-head", "/tmp/h.gguf", "--target", sys.executable, "--init", "/nonexistent/h.gguf"], "--init"),
    (["eval-head", "/tmp/h.gguf", "--target", sys.executable], "--suite"),
    (["eval-head", "/tmp/h.gguf", "--target", sys.executable, "--suite", "all", "--work-dir", "/tmp"], "--work-dir"),
    (["eval-head", sys.executable, "--target", sys.executable, "--suite", "no-such-suite"], "suite"),
    (["eval-head", sys.executable, "--target", sys.executable, "--suite", "all", "--max-new", "1"], "--max-new"),
])
def test_train_head_bad_input(args, needle):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_head_cost_refuses_a_plain_model(demo_pair):
    r = run("head-cost", str(demo_pair.draft), "--target", str(demo_pair.target), "--rounds", "2")
    assert r.returncode == 2 and "not an EAGLE-3 head" in r.stderr, r.stderr


@pytest.mark.slow
def test_eval_head_on_a_suite_reports_each_category(tiny_head, demo_pair, tmp_path):
    import json

    suite = tmp_path / "mine.jsonl"
    suite.write_text("\n".join(json.dumps(p) for p in [
        {"id": "a", "category": "faq", "prompt": "What is the capital of France?"},
        {"id": "b", "category": "faq", "prompt": "Name three colours."},
        {"id": "c", "category": "code", "prompt": "Write a Python function that adds two numbers."},
    ]))
    r = run("eval-head", str(tiny_head["path"]), "--target", str(demo_pair.target), "--suite", str(suite),
            "--max-new", "12", "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    cats = out["by_category"]
    assert set(cats) == {"faq", "code", "overall"} and out["prompts"] == 3
    assert cats["overall"]["positions"] == cats["faq"]["positions"] + cats["code"]["positions"] > 12
    for c in cats.values():
        d1, d2, d3 = c["acceptance_by_depth"]
        assert 1 >= d1 >= d2 >= d3 >= 0 and c["chain3_tau"] == pytest.approx(1 + d1 + d2 + d3)
