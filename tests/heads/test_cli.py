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
])
def test_train_head_bad_input(args, needle):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_head_cost_refuses_a_plain_model(demo_pair):
    r = run("head-cost", str(demo_pair.draft), "--target", str(demo_pair.target), "--rounds", "2")
    assert r.returncode == 2 and "not an EAGLE-3 head" in r.stderr, r.stderr
