"""The bench's shell tools parse, and the flags tools/gpu-bench.sh passes exist on the CLI."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["tools/llama-anchor.sh", "tools/gpu-bench.sh", "tools/run-serve-benchmarks.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses_and_is_executable(script):
    path = ROOT / script
    assert path.stat().st_mode & 0o111
    subprocess.run(["bash", "-n", str(path)], check=True)


def _help(*command: str) -> str:
    return subprocess.run([sys.executable, "-m", *command, "--help"], capture_output=True, text=True, cwd=ROOT,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}, check=True).stdout


@pytest.mark.parametrize("marker, command, extra", [
    ("bench-serve --concurrency", ("edgespec.cli.main", "bench-serve"), "GPU=(--n-gpu-layers -1"),
    ("edgespec.bench.cost_curve --model", ("edgespec.bench.cost_curve",), "GPU=(--n-gpu-layers -1"),
    ("edgespec.bench.mismatch --target", ("edgespec.bench.mismatch",), "GPU=(--n-gpu-layers -1"),
    ("plan --measure --target", ("edgespec.cli.main", "plan"), "PLAN=(--no-flash-attn"),
])
def test_gpu_bench_flags_exist(marker, command, extra):
    """Every option tools/gpu-bench.sh passes to a command (up to the end of the step, and the
    GPU options it adds) is one the command takes."""
    text = (ROOT / "tools/gpu-bench.sh").read_text()
    call = re.split(r"(?<!\\)\n", text[text.index(marker):])[0]  # to the first line without a continuation
    gpu = text[text.index(extra):].split("\n")[0]
    flags = set(re.findall(r"(--[a-z][a-z-]+)", call + gpu))
    help_text = _help(*command)
    assert flags and all(f in help_text for f in flags), flags - {f for f in flags if f in help_text}


def test_gpu_bench_usage():
    proc = subprocess.run([str(ROOT / "tools/gpu-bench.sh"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr


def test_anchor_script_usage():
    proc = subprocess.run([str(ROOT / "tools/llama-anchor.sh")], capture_output=True, text=True)
    assert proc.returncode == 2 and "tools/llama-anchor.sh build" in proc.stderr


def test_serve_benchmark_script_flags_exist():
    text = (ROOT / "tools/run-serve-benchmarks.sh").read_text()
    call = text[text.index("$ES bench-serve"):]
    flags = set(re.findall(r"(--[a-z][a-z-]+)", call))
    help_text = _help("edgespec.cli.main", "bench-serve")
    assert flags and all(f in help_text for f in flags), flags - {f for f in flags if f in help_text}


def test_anchor_builds_llama_server_and_batched_bench():
    text = (ROOT / "tools/llama-anchor.sh").read_text()
    assert "llama-server" in text[text.index("TARGETS=("):].split("\n")[0]
    assert "llama-batched-bench" in text[text.index("EXTRA_TARGETS=("):].split("\n")[0]
    assert "-DLLAMA_BUILD_SERVER=ON" in text
