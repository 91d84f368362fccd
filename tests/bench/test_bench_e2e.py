"""`edgespec bench` end to end on the demo pair: a 2-prompt suite, 16 tokens, every mode,
`--n-gpu-layers -1` (ignored by a CPU build: the same command runs unchanged on a CUDA build).
One thread: on a shared 2-core box, 2 OpenMP threads spin on a taken core and run 10x slower."""

import json
import subprocess
import sys

import pytest

from edgespec.config import models_dir

TARGET = models_dir() / "SmolLM2-135M-Instruct.F32.gguf"
DRAFT = models_dir() / "SmolLM2-135M-Instruct.Q8_0.gguf"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (TARGET.is_file() and DRAFT.is_file()), reason="demo models missing: make models"),
]


def test_bench_end_to_end(tmp_path):
    suite = tmp_path / "tiny.jsonl"
    suite.write_text(
        '{"id": "t-code", "category": "code", "prompt": "Write a Python function add(a, b) that returns a + b."}\n'
        '{"id": "t-drift", "category": "drift", "prompt": "Reverse every word: the cat sat on the mat."}\n'
    )
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "edgespec.cli.main", "bench", "--suite", str(suite), "--max-tokens", "16",
           "--modes", "plain,chain,tree,auto", "--n-gpu-layers", "-1", "--threads", "1",
           "--json", f"{out}.json", "--markdown", f"{out}.md", "--plot", f"{out}.png"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bench: 100%" in proc.stderr and "8/8" in proc.stderr  # the progress bar
    report = json.loads(open(f"{out}.json").read())
    rows = report["results"]
    assert [(r["id"], r["mode"]) for r in rows] == [
        ("t-code", "plain"), ("t-code", "chain"), ("t-code", "tree"), ("t-code", "auto"),
        ("t-drift", "chain"), ("t-drift", "tree"), ("t-drift", "auto"), ("t-drift", "plain"),
    ]
    for r in rows:
        assert 1 <= r["tokens"] <= 16 and r["seconds"] > 0 and r["tokens_per_second"] > 0
        assert r["target_forwards"] >= 1 and r["tau"] > 0
    # greedy decoding is exact: every mode emits the same number of tokens for a prompt
    for pid in ("t-code", "t-drift"):
        assert len({r["tokens"] for r in rows if r["id"] == pid}) == 1
    assert set(report["summary"]) == {"code", "drift", "overall"}
    assert report["machine"]["backend"] == "cpu" and report["settings"]["n_gpu_layers"] == -1
    assert report["settings"]["threads"] == 1
    assert "| code | plain | 1 |" in open(f"{out}.md").read()
    assert open(f"{out}.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"

