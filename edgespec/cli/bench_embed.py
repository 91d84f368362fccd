"""`edgespec bench-embed`: embedding throughput (inputs per second) at 1 and 8 concurrent callers,
edgespec's /v1/embeddings against llama-server `--embeddings` on the same GGUF (edgespec/bench/embed.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import typer

from edgespec.cli.common import user_errors


def _start_edgespec(model: str, threads: int, workdir: Path, timeout: float = 600.0):
    """`edgespec serve` on `model` with the HTTP API on and drafting off; (process, base URL)."""
    from edgespec.bench.serve_systems import LOOPBACK, Process, ServerStartError, free_port, toml_config

    port = free_port()
    sections: dict[str, dict[str, Any]] = {
        "server": {"host": LOOPBACK, "port": 0, "parallel": 1, "grace_seconds": 2.0},
        "target": {"path": model, "n_ctx": 512, "threads": threads},
        "draft": {"enabled": False, "head": "none"},
        "embedding": {"threads": threads, "pooling": "mean"},
        "rerank": {"enabled": False},
        "http": {"enabled": True, "host": LOOPBACK, "port": port},
        "logging": {"level": "warning", "json": True},
    }
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "edgespec-embed.toml"
    cfg.write_text(toml_config(sections), encoding="utf-8")
    log = cfg.with_suffix(".log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGESPEC_") or k == "EDGESPEC_HOME"}
    cmd = [sys.executable, "-m", "edgespec.cli.main", "serve", "--config", str(cfg)]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True, env=env)
    p = Process("edgespec", proc, "", log, cmd)
    serving = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("SERVING "):
                serving.set()

    threading.Thread(target=read, daemon=True).start()
    if not serving.wait(timeout):
        p.stop(5)
        raise ServerStartError(f"edgespec serve did not start:\n{p.log_tail()}")
    return p, f"http://{LOOPBACK}:{port}"


def _start_llama_server(bin_dir: Path, model: str, threads: int, callers: int, workdir: Path,
                        timeout: float = 600.0):
    from edgespec.bench.serve_systems import LOOPBACK, Process, ServerStartError, free_port

    exe = bin_dir / "llama-server"
    if not exe.is_file():
        raise ServerStartError(f"{exe} not found (build it: tools/llama-anchor.sh build)")
    port = free_port()
    # one slot per caller, 512 cells each, mean pooling as edgespec's (the GGUF has no pooling_type)
    cmd = [str(exe), "-m", model, "--embeddings", "--pooling", "mean", "--host", LOOPBACK, "--port", str(port),
           "-np", str(callers), "-c", str(512 * callers), "-b", "2048", "-ub", "2048", "-t", str(threads),
           "-tb", str(threads), "--no-webui"]
    log = workdir / "llama-server-embed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    p = Process("llama-server", proc, f"{LOOPBACK}:{port}", log, cmd)
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise ServerStartError(f"llama-server exited with {proc.returncode}:\n{p.log_tail()}")
        try:
            if httpx.get(f"http://{LOOPBACK}:{port}/health", timeout=2).status_code == 200:
                return p, f"http://{LOOPBACK}:{port}"
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    p.stop(5)
    raise ServerStartError(f"llama-server not healthy after {timeout:.0f} s:\n{p.log_tail()}")


def bench_embed(
    model: Path | None = typer.Option(None, "--model", help="GGUF to embed with (default: the demo target)"),
    llama_server_bin: Path | None = typer.Option(None, "--llama-server-bin", help="directory holding "
                                                    "llama-server (none: edgespec alone)"),
    callers: str = typer.Option("1,8", help="comma-separated concurrent callers"),
    requests: int = typer.Option(64, help="inputs per level and round (one input per request)"),
    rounds: int = typer.Option(2, help="interleaved rounds (systems alternate)"),
    threads: int = typer.Option(0, help="CPU threads of each server (0: all cores)"),
    out: Path = typer.Option(Path("bench-embed"), "--out", help="directory for the JSON, markdown and logs"),
) -> None:
    """Embedding throughput at N concurrent callers: edgespec against llama-server --embeddings."""
    from edgespec.bench import embed
    from edgespec.config import models_dir
    from edgespec.server.config import DEMO_TARGET
    from edgespec.server.models_api import model_name

    with user_errors():
        ns = [int(x) for x in callers.split(",") if x.strip()]
        path = str(model or models_dir() / DEMO_TARGET)
        n_threads = threads or (os.cpu_count() or 1)
        procs = []
        try:
            p, base = _start_edgespec(path, n_threads, out)
            procs.append(p)
            systems = {"edgespec": (base, model_name(path) + "-embedding")}
            if llama_server_bin is not None:
                q, lbase = _start_llama_server(llama_server_bin, path, n_threads, max(ns), out)
                procs.append(q)
                systems["llama-server"] = (lbase, "x")
            levels = embed.bench(systems, callers=ns, requests=requests, rounds=rounds)
        finally:
            for p in procs:
                p.stop()
        meta = {"model": path, "threads": n_threads, "requests": requests, "rounds": rounds,
                "cpu_count": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        data, md = embed.report(levels, meta)
    out.mkdir(parents=True, exist_ok=True)
    (out / "embed.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / "embed.md").write_text(md)
    typer.echo(md)


def register(app: typer.Typer) -> None:
    app.command("bench-embed")(bench_embed)
