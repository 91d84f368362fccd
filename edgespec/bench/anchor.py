"""The llama.cpp anchor: run llama.cpp's own binaries (built by tools/llama-anchor.sh from the
llama.cpp vendored in the pinned llama-cpp-python sdist) on a bench suite, and parse their
throughput: `llama-completion` for plain decoding, `llama-speculative-simple` for llama.cpp's own
draft-model speculation, optionally `llama-bench` for the synthetic text-generation figure.

Both binaries get the same text as `edgespec bench`: the user prompt in the target's chat
template (the engine's `chat_prompt`), tokenized by llama.cpp with add_special and parse_special; greedy (--temp 0), the same token budget (-n), the same threads. Their tok/s
count decoding only (prompt processing excluded), as does the engine's `stats.seconds`.

usage: python -m edgespec.bench.anchor --bin DIR --suite NAME|FILE --target T --draft D [...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edgespec.bench.runner import mode_order
from edgespec.bench.suite import Prompt, load_suite

ANCHOR_MODES = ("plain", "speculative")

# common_perf_print: "eval time =  1234.56 ms /   127 runs   (  9.72 ms per token,  102.87 tokens per second)"
# (lines may carry a log timestamp prefix; "prompt eval time" is the prefill, not wanted)
_EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs")
# llama-speculative-simple: "decoded  129 tokens in    3.512 seconds, speed:   36.731 t/s"
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")


class AnchorError(RuntimeError):
    pass


def parse_completion(output: str) -> dict[str, Any]:
    """tokens and seconds of the decode phase from llama-completion's perf print."""
    evals = list(_EVAL.finditer(output))
    if not evals:
        raise AnchorError("no 'eval time' line in llama-completion output")
    m = evals[-1]
    seconds, tokens = float(m.group(1)) / 1000.0, int(m.group(2))
    return {"tokens": tokens, "seconds": round(seconds, 6),
            "tokens_per_second": round(tokens / seconds, 3) if seconds > 0 else 0.0}


def parse_speculative(output: str) -> dict[str, Any]:
    """tokens, seconds and draft acceptance from llama-speculative-simple's summary."""
    m = _DECODED.search(output)
    if not m:
        raise AnchorError("no 'decoded N tokens' line in llama-speculative-simple output")
    tokens, seconds = int(m.group(1)), float(m.group(2))
    row: dict[str, Any] = {"tokens": tokens, "seconds": round(seconds, 6),
                           "tokens_per_second": round(tokens / seconds, 3) if seconds > 0 else 0.0}
    if d := _DRAFTED.search(output):
        row["n_drafted"] = int(d.group(1))
    if a := _ACCEPT.search(output):
        row["n_accept"] = int(a.group(1))
    return row


def completion_cmd(bin_dir: Path, a: argparse.Namespace, text: str) -> list[str]:
    return [str(bin_dir / "llama-completion"), "-m", a.target, "-p", text, "-n", str(a.max_tokens),
            "--temp", "0", "--seed", "0", "-t", str(a.threads), "-c", str(a.n_ctx), "-ngl", str(a.n_gpu_layers),
            "-no-cnv", "--no-display-prompt", "--perf"]


def speculative_cmd(bin_dir: Path, a: argparse.Namespace, text: str) -> list[str]:
    return [str(bin_dir / "llama-speculative-simple"), "-m", a.target, "-md", a.draft, "--spec-type", "draft-simple", "-p", text,
            "-n", str(a.max_tokens), "--temp", "0", "--seed", "0", "-t", str(a.threads), "-td", str(a.threads),
            "-c", str(a.n_ctx), "-ngl", str(a.n_gpu_layers), "-ngld", str(a.n_gpu_layers),
            "--spec-draft-n-max", str(a.draft_max)]


def run_mode(bin_dir: Path, a: argparse.Namespace, mode: str, text: str) -> tuple[list[str], dict[str, Any]]:
    """One llama.cpp run of `mode` ("plain" | "speculative") on `text`: its command and parsed row."""
    if mode == "plain":
        cmd = completion_cmd(bin_dir, a, text)
        return cmd, parse_completion(_run(cmd, a.timeout))
    cmd = speculative_cmd(bin_dir, a, text)
    return cmd, parse_speculative(_run(cmd, a.timeout))


def example_command(cmd: list[str]) -> str:
    """The command with the prompt text elided (it follows -p, at index 5)."""
    return shlex.join(cmd[:5] + ["<prompt>"] + cmd[6:])


def _run(cmd: list[str], timeout: float) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise AnchorError(f"timed out after {timeout:.0f} s: {shlex.join(cmd[:3])} ...") from None
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AnchorError(f"exit {proc.returncode}: {shlex.join(cmd[:1])}\n{out[-2000:]}")
    return out


def chat_texts(target: str, prompts: Sequence[Prompt]) -> dict[str, str]:
    """The prompts in the target's chat template, from the engine's own `chat_prompt` (the
    target alone, no calibration), so the llama.cpp binaries get the very text the bench sends."""
    from edgespec.config import EngineConfig, ModelConfig
    from edgespec.engine import Engine

    engine = Engine.load(EngineConfig(target=ModelConfig(path=target, n_ctx=512), draft=None), calibrate=False)
    try:
        return {p.id: engine.chat_prompt([("user", p.prompt)]) for p in prompts}
    finally:
        engine.close()


def interleaved_runners(bin_dir: Path, *, target: str, draft: str, max_tokens: int, threads: int, n_ctx: int,
                        n_gpu_layers: int = 0, draft_max: int = 4, timeout: float = 600.0) -> dict[str, Any]:
    """What `edgespec bench --anchor-bin` needs to run llama.cpp's binaries inside its own
    rotation of modes (prompt by prompt, beside edgespec's modes): {"runners": {mode: fn(prompt,
    text) -> row}, "settings", "example_commands", "command"}. Modes are "plain" and "speculative",
    as in an anchor JSON."""
    for name in ("llama-completion", "llama-speculative-simple"):
        if not (bin_dir / name).is_file():
            raise AnchorError(f"{bin_dir / name} not found (build it: tools/llama-anchor.sh build)")
    a = argparse.Namespace(target=target, draft=draft, max_tokens=max_tokens, threads=threads, n_ctx=n_ctx,
                           n_gpu_layers=n_gpu_layers, draft_max=draft_max, timeout=timeout)
    examples: dict[str, str] = {}

    def runner(mode: str):
        def run(prompt: Prompt, text: str) -> dict[str, Any]:
            cmd, parsed = run_mode(bin_dir, a, mode, text)
            examples.setdefault(mode, example_command(cmd))
            return parsed
        return run

    return {
        "runners": {m: runner(m) for m in ANCHOR_MODES},
        "settings": {"max_tokens": max_tokens, "threads": threads, "n_ctx": n_ctx, "n_gpu_layers": n_gpu_layers,
                     "draft_max": draft_max, "target": target, "draft": draft, "temperature": 0.0,
                     "interleaved": True, "bin": str(bin_dir),
                     "binaries": {"plain": "llama-completion", "speculative": "llama-speculative-simple"}},
        "example_commands": examples,
    }


def llama_bench(bin_dir: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    """llama-bench's synthetic text generation (-p 0 -n N) for the target: the usual plain figure."""
    out = _run([str(bin_dir / "llama-bench"), "-m", a.target, "-p", "0", "-n", str(a.max_tokens),
                "-t", str(a.threads), "-ngl", str(a.n_gpu_layers), "-r", "3", "-o", "json"], a.timeout)
    data = json.loads(out[out.index("["): out.rindex("]") + 1])
    return [{k: d.get(k) for k in ("model_type", "n_gen", "n_threads", "avg_ts", "stddev_ts")} for d in data]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llama-anchor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, type=Path, help="directory with the llama.cpp binaries")
    ap.add_argument("--suite", default="structured")
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="as the engine: all cores")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--draft-max", type=int, default=4, help="llama.cpp --spec-draft-n-max (edgespec chain: 4)")
    ap.add_argument("--modes", default=",".join(ANCHOR_MODES))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--llama-bench", action="store_true", help="also run llama-bench -p 0 -n N")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if bad := [m for m in modes if m not in ANCHOR_MODES]:
        ap.error(f"--modes: unknown {bad}, allowed {ANCHOR_MODES}")

    prompts = load_suite(a.suite, limit=a.limit)
    texts = chat_texts(a.target, prompts)
    from edgespec.bench.report import machine_info

    report: dict[str, Any] = {
        "command": "python -m edgespec.bench.anchor " + shlex.join(sys.argv[1:] if argv is None else list(argv)),
        "settings": {"suite": a.suite, "max_tokens": a.max_tokens, "threads": a.threads, "n_ctx": a.n_ctx,
                     "n_gpu_layers": a.n_gpu_layers, "draft_max": a.draft_max, "target": a.target,
                     "draft": a.draft, "temperature": 0.0, "prompt_text": "engine.chat_prompt([('user', prompt)])",
                     "binaries": {"plain": "llama-completion", "speculative": "llama-speculative-simple"}},
        "machine": machine_info(),
        "example_commands": {},
        "results": [],
    }
    for i, p in enumerate(prompts):
        for mode in mode_order(modes, i):
            cmd, parsed = run_mode(a.bin, a, mode, texts[p.id])
            report["example_commands"].setdefault(mode, example_command(cmd))
            row = {"id": p.id, "category": p.category, "mode": mode, **parsed}
            report["results"].append(row)
            print(f"{p.id:<12} {mode:<12} {row['tokens']:>4} tok {row['tokens_per_second']:8.2f} tok/s",
                  file=sys.stderr, flush=True)
    if a.llama_bench:
        report["llama_bench"] = llama_bench(a.bin, a)
    text = json.dumps(report, indent=2, ensure_ascii=False) + "\n"
    if a.json_out:
        Path(a.json_out).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
