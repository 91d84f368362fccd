"""The bench's shell tools parse, and the flags tools/gpu-check.sh passes exist on the CLI."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["tools/llama-anchor.sh", "tools/gpu-prep.sh", "tools/gpu-check.sh", "tools/gpu-bench.sh", "tools/run-serve-benchmarks.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses_and_is_executable(script):
    path = ROOT / script
    assert path.stat().st_mode & 0o111
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_gpu_check_bench_flags_exist():
    text = (ROOT / "tools/gpu-check.sh").read_text()
    call = text[text.index("tools/gpu-bench-launch.py bench"):]
    call = call[: call.index("|| fail")]
    flags = set(re.findall(r"(--[a-z][a-z-]+)", call))
    help_text = subprocess.run([sys.executable, "-m", "edgespec.bench", "--help"], capture_output=True, text=True,
                               cwd=ROOT, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}, check=True).stdout
    assert flags and all(f in help_text for f in flags), flags - {f for f in flags if f in help_text}


def test_anchor_script_usage():
    proc = subprocess.run([str(ROOT / "tools/llama-anchor.sh")], capture_output=True, text=True)
    assert proc.returncode == 2 and "tools/llama-anchor.sh build" in proc.stderr


def test_serve_benchmark_script_flags_exist():
    text = (ROOT / "tools/run-serve-benchmarks.sh").read_text()
    call = text[text.index("$ES bench-serve"):]
    flags = set(re.findall(r"(--[a-z][a-z-]+)", call))
    help_text = subprocess.run([sys.executable, "-m", "edgespec.cli.main", "bench-serve", "--help"], capture_output=True,
                               text=True, cwd=ROOT, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}, check=True).stdout
    assert flags and all(f in help_text for f in flags), flags - {f for f in flags if f in help_text}


def test_anchor_builds_llama_server():
    text = (ROOT / "tools/llama-anchor.sh").read_text()
    assert "llama-server" in text[text.index("TARGETS=("):].split("\n")[0]
    assert "-DLLAMA_BUILD_SERVER=ON" in text
