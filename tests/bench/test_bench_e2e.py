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
    md = open(f"{out}.md").read()
    assert "| code | plain | 1 |" in md
    # the ceiling comes from this run's measured costs: a real draft forward costs a fraction of
    # a target forward, and a perfect draft's bound sits between plain and the free-drafting one
    bound = report["ceiling"]
    assert 0 < bound["draft_over_target"] < 1.5 and bound["target_ms"] > 0
    for c in bound["chain"].values():
        assert 0 < c["perfect_draft"] < c["free_draft"]
    assert report["headline"]["perfect_draft_ceiling"] == bound["best_perfect_draft"]
    assert "## The ceiling these costs allow" in md
    assert open(f"{out}.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"



def test_bench_runs_llama_cpp_interleaved(tmp_path):
    """`--anchor-bin`: llama.cpp's binaries run as subprocesses inside the bench's rotation, get the
    bench's chat text and models, and their parsed throughput lands in the report's anchor section
    (marked interleaved). Stand-in binaries print what the real ones print."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    scripts = {
        "llama-completion": 'echo "llama_perf_context_print:        eval time =     200.00 ms /    15 runs"',
        "llama-speculative-simple": 'echo "decoded   16 tokens in    0.100 seconds, speed:  160.000 t/s"; '
                                    'echo "n_drafted = 20"; echo "n_accept  = 12"',
    }
    for name, body in scripts.items():
        p = bin_dir / name
        p.write_text(f'#!/bin/sh\nprintf "%s\\n" "=== $(basename "$0") $*" >> "{log}"\n{body}\n')
        p.chmod(0o755)
    suite = tmp_path / "tiny.jsonl"
    suite.write_text('{"id": "t-json", "category": "json", "prompt": "Give {\\"a\\": 1} back as JSON."}\n'
                     '{"id": "t-code", "category": "code", "prompt": "Write add(a, b) in Python."}\n')
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "edgespec.cli.main", "bench", "--suite", str(suite), "--max-tokens", "8",
           "--modes", "plain,auto", "--threads", "1", "--anchor-bin", str(bin_dir), "--json", str(out),
           "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    anchor = report["anchor"]
    assert anchor["interleaved"] is True and anchor["settings"]["draft"] == str(DRAFT)
    assert sorted((r["id"], r["mode"]) for r in anchor["results"]) == [
        ("t-code", "plain"), ("t-code", "speculative"), ("t-json", "plain"), ("t-json", "speculative")]
    spec = next(r for r in anchor["results"] if r["mode"] == "speculative")
    assert spec["tokens_per_second"] == 160.0 and spec["n_accept"] == 12
    assert anchor["edgespec_over_llama_cpp"]["overall"]["auto"]["llama_cpp_mode"] == "speculative"
    assert "ran inside this run's rotation" in proc.stdout
    calls = log.read_text().split("=== ")[1:]  # one per call (the chat text spans lines)
    assert len(calls) == 4
    assert all(f"-m {TARGET}" in c for c in calls) and sum(f"-md {DRAFT}" in c for c in calls) == 2
    assert all("<|im_start|>user" in c and "-n 8" in c and "-t 1" in c for c in calls)


def test_bench_sizes_the_context_for_long_prompts(tmp_path):
    """A suite with a prompt longer than the default 2048-token context: the bench loads the
    models with the context it needs (the report says which); with --n-ctx too small it stops
    before any run with an error naming the field and the prompt."""
    # ~2,150 tokens: just past the default context, so the reloaded engine's prefill stays short
    ctx = " ".join(f"Item {i}: field {i} holds {i * 7}." for i in range(270))
    suite = tmp_path / "long.jsonl"
    suite.write_text(json.dumps({"id": "long-rag", "category": "rag_answers",
                                 "prompt": f"Context: {ctx}\nQuestion: what does field 42 hold?"}) + "\n")
    base = [sys.executable, "-m", "edgespec.cli.main", "bench", "--suite", str(suite), "--max-tokens", "4",
            "--modes", "auto", "--no-progress", "--no-warmup", "--threads", "1"]
    proc = subprocess.run(base + ["--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["settings"]["n_ctx"] > 2048 and report["settings"]["n_ctx"] % 256 == 0
    assert [r["mode"] for r in report["results"]] == ["auto"]  # auto prefills both the target and the draft
    assert report["headline"]["structured_categories"] == ["rag_answers"]
    proc = subprocess.run(base + ["--n-ctx", "2048"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert "error: n_ctx: prompt 'long-rag' needs a context of" in proc.stderr and "got 2048" in proc.stderr


def test_bench_samples_with_temperature(tmp_path):
    """--temperature: every mode samples (the same seed per prompt), the report says so."""
    suite = tmp_path / "tiny.jsonl"
    suite.write_text('{"id": "t-json", "category": "json", "prompt": "Give {\\"a\\": 1} back as JSON."}\n')
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "edgespec.cli.main", "bench", "--suite", str(suite), "--max-tokens", "24",
           "--modes", "plain,chain,auto", "--threads", "1", "--temperature", "0.8", "--top-p", "0.95",
           "--seed", "7", "--json", f"{out}.json", "--markdown", f"{out}.md", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(open(f"{out}.json").read())
    s = report["settings"]
    assert (s["temperature"], s["top_p"], s["seed"]) == (0.8, 0.95, 7)
    assert {r["mode"] for r in report["results"]} == {"plain", "chain", "auto"}
    assert all(r["tokens"] >= 1 for r in report["results"])
    assert "sampled (temperature 0.8, top_p 0.95; seed 7 + prompt index)" in open(f"{out}.md").read()
