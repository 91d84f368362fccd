"""`edgespec bench-serve` end to end: real `edgespec serve` daemons on loopback with the demo
models, real gRPC streaming clients, at concurrency 1 and 2; llama.cpp's llama-server beside
them when tools/llama-anchor.sh has built it (skipped otherwise). Small: 2 prompts, 8 tokens,
one thread per server (on a shared 2-core box more threads spin on a taken core)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.config import models_dir

TARGET = models_dir() / "SmolLM2-135M-Instruct.F32.gguf"
DRAFT = models_dir() / "SmolLM2-135M-Instruct.Q8_0.gguf"
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (TARGET.is_file() and DRAFT.is_file()), reason="demo models missing: make models"),
]


def llama_server_bin() -> Path | None:
    """$EDGESPEC_LLAMA_BIN, else the newest build of tools/llama-anchor.sh that has llama-server."""
    if os.environ.get("EDGESPEC_LLAMA_BIN"):
        return Path(os.environ["EDGESPEC_LLAMA_BIN"])
    cache = Path(os.environ.get("EDGESPEC_ANCHOR_CACHE", Path.home() / ".cache/edgespec")) / "llama-anchor"
    found = sorted(cache.glob("*/bin/llama-server"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def run(tmp_path: Path, *extra: str) -> dict:
    suite = tmp_path / "tiny.jsonl"
    suite.write_text(
        '{"id": "t-code", "category": "code", "prompt": "Write a Python function add(a, b) that returns a + b."}\n'
        '{"id": "t-json", "category": "json", "prompt": "Give {\\"name\\": \\"Ada\\"} as JSON with an age of 36."}\n'
    )
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "edgespec.cli.main", "bench-serve", "--suite", str(suite), "--max-tokens", "8",
           "--requests", "2", "--rounds", "2", "--threads", "1", "--workdir", str(tmp_path / "w"),
           "--json", f"{out}.json", "--markdown", f"{out}.md", "--plot", f"{out}.png", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bench-serve: 100%" in proc.stderr  # the progress bar
    assert open(f"{out}.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    report = json.loads(open(f"{out}.json").read())
    report["_md"] = open(f"{out}.md").read()
    return report


def check_cell(sys_cell: dict, requests: int) -> None:
    c = sys_cell["pooled"]
    assert c["requests"] == requests and c["errors"] == 0
    assert 1 <= c["completion_tokens"] <= 8 * requests
    assert sys_cell["tokens_per_second"] > 0 and len(sys_cell["rounds_tokens_per_second"]) == 2
    assert 0 < c["ttft_p50_s"] <= c["ttft_p99_s"]
    assert 0 <= c["itl_p50_s"] <= c["itl_p99_s"] and c["tpot_mean_s"] > 0
    for r in sys_cell["requests"]:
        assert r["error"] is None and 1 <= r["tokens"] <= 8 and r["ttft_s"] > 0
        assert r["finish_reason"] in ("length", "eos")


def test_edgespec_daemon_at_concurrency_1_and_2(tmp_path):
    report = run(tmp_path, "--concurrency", "1,2", "--no-scenario")
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for lv in report["levels"]:
        assert set(lv["systems"]) == {"edgespec-auto", "edgespec-plain"}
        assert lv["daemon"]["parallel"] == lv["concurrency"]  # a daemon per level, parallel = N
        for cell in lv["systems"].values():
            check_cell(cell, 2)
        # the daemon's own speculation stats: plain decoding makes one target forward per token
        assert lv["systems"]["edgespec-plain"]["pooled"]["tau"] == pytest.approx(1.0)
        assert lv["systems"]["edgespec-auto"]["pooled"]["tau"] >= 1.0
        assert len(lv["ratios"]["edgespec-auto / edgespec-plain"]["rounds"]) == 2
        # greedy is exact: both modes emit the same tokens for the same prompts
        toks = {s: sorted((r["prompt_id"], r["tokens"]) for r in c["requests"]) for s, c in lv["systems"].items()}
        assert toks["edgespec-auto"] == toks["edgespec-plain"]
    assert report["settings"]["prompt_cache"] is False
    assert "| 2 | edgespec-plain |" in report["_md"]


def test_llama_server_beside_edgespec_and_the_long_prompt_scenario(tmp_path):
    bin_dir = llama_server_bin()
    if bin_dir is None or not (bin_dir / "llama-server").is_file():
        pytest.skip("llama-server not built (tools/llama-anchor.sh build)")
    report = run(tmp_path, "--concurrency", "1", "--modes", "auto", "--llama-server-bin", str(bin_dir),
                 "--scenario-tokens", "300", "--scenario-stream-tokens", "24", "--scenario-long-tokens", "2",
                 "--scenario-rounds", "1")
    lv = report["levels"][0]
    assert set(lv["systems"]) == {"edgespec-auto", "llama-server", "llama-server-draft"}
    for cell in lv["systems"].values():
        check_cell(cell, 2)
    assert lv["systems"]["llama-server-draft"]["pooled"]["drafted_tokens"] > 0  # its own draft stats
    assert {"edgespec-auto / llama-server", "edgespec-auto / llama-server-draft",
            "llama-server-draft / llama-server"} <= set(lv["ratios"])
    # the same prompt tokens reach both servers
    for s in ("llama-server", "llama-server-draft"):
        got = {r["prompt_id"]: r["prompt_tokens"] for r in lv["systems"][s]["requests"]}
        assert got == {k: v for k, v in lv["prompt_tokens"].items() if k in got}
    assert "127.0.0.1" in report["commands"]["llama-server"] and "-md" in report["commands"]["llama-server-draft"]
    sc = report["scenario"]
    assert set(sc["systems"]) == set(lv["systems"])
    for name, r in sc["systems"].items():
        m = r["median"]
        assert 280 <= m["long_prompt_tokens"] <= 300, name
        assert m["long_ttft_s"] > 0 and m["window_itl_max_s"] >= m["window_itl_p50_s"] > 0, name
    assert "## A 300-token prompt arriving while 3 streams decode" in report["_md"]
