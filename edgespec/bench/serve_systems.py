"""The serving benchmark's servers, as real processes on loopback: `edgespec serve` with a
temporary config (parallel = N, the given models, port 0, the prompt cache as asked) and llama.cpp's
llama-server (-np N, -c N x the per-request context, the same threads; with or without the
draft). Each is started, waited for, and stopped by its own handle."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"


class ServerStartError(RuntimeError):
    pass


def toml_config(sections: dict[str, dict[str, Any]]) -> str:
    """Flat TOML (sections of str / int / float / bool keys): the daemon's temporary config."""
    lines: list[str] = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        for k, v in table.items():
            if isinstance(v, bool):
                lines.append(f"{k} = {'true' if v else 'false'}")
            elif isinstance(v, (int, float)):
                lines.append(f"{k} = {v}")
            elif isinstance(v, str):
                lines.append(f"{k} = {_toml_str(v)}")
            else:
                raise TypeError(f"{name}.{k}: unsupported TOML value {v!r}")
        lines.append("")
    return "\n".join(lines)


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def daemon_sections(*, target: str, draft: str | None, parallel: int, n_ctx: int, threads: int,
                    max_tokens: int, n_gpu_layers: int = 0, suffix_cache: bool = False,
                    prompt_cache: bool = False, head: str = "none",
                    flash_attn: bool = True, chat_template: str | None = None,
                    pad_forwards: str | bool = "auto") -> dict[str, dict[str, Any]]:
    """The daemon's config for one concurrency level. No prompt cache unless asked
    (`prompt_cache`; llama-server then gets `cache_prompt: true`, else false), so by default both
    prefill every request in full. No suffix cache unless asked
    (`suffix_cache`): the rounds repeat the same prompts, and the cache would hand the later
    rounds the earlier rounds' replies. `head`: the [draft] head (a GGUF beside the draft, or none).
    `flash_attn`: both models' (off for a CUDA build without its flash-attention kernels).
    `chat_template`: the target's [target] chat_template (a file), for a GGUF without one.
    `pad_forwards`: [speculation] pad_forwards (auto: on with a target on a GPU)."""
    model = {"n_ctx": n_ctx, "threads": threads, "n_gpu_layers": n_gpu_layers, "flash_attn": flash_attn}
    target_extra = {"chat_template": chat_template} if chat_template else {}
    return {
        "server": {"host": LOOPBACK, "port": 0, "parallel": parallel, "queue_size": max(16, 2 * parallel),
                   "max_tokens": max(max_tokens, 16), "default_max_tokens": max(min(max_tokens, 256), 1),
                   "prompt_cache": prompt_cache, "grace_seconds": 5.0},
        "target": {"path": target, **model, **target_extra},
        "draft": {"path": draft or "", "enabled": draft is not None, "head": head, **model},
        "speculation": {"suffix_cache": suffix_cache, "pad_forwards": pad_forwards},
        "logging": {"level": "warning", "json": True},
    }


@dataclass
class Process:
    """A started server: its process, address, log file."""

    name: str
    proc: subprocess.Popen
    addr: str
    log: Path
    command: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def start_daemon(workdir: Path, sections: dict[str, dict[str, Any]], *, timeout: float = 900.0,
                 python: str = sys.executable) -> Process:
    """`edgespec serve --config TMP` as a subprocess; returns once it prints `SERVING host:port`
    (both models loaded, calibrated and warmed)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / f"edgespec-np{sections['server']['parallel']}.toml"
    cfg.write_text(toml_config(sections), encoding="utf-8")
    log = cfg.with_suffix(".log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGESPEC_") or k == "EDGESPEC_HOME"}
    cmd = [python, "-m", "edgespec.cli.main", "serve", "--config", str(cfg)]
    err = open(log, "w")  # the child writes it; closed when the child is stopped
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True, env=env)
    err.close()
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    line = box[0] if box else ""
    p = Process("edgespec", proc, "", log, cmd)
    if not line.startswith("SERVING "):
        p.stop(5)
        raise ServerStartError(f"edgespec serve did not start ({line.strip()!r}):\n{p.log_tail()}")
    p.addr = line.split()[1]
    return p


def free_port() -> int:
    """A port free on loopback now (llama-server takes a fixed --port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def llama_server_cmd(bin_dir: Path, *, target: str, draft: str | None, parallel: int, n_ctx: int, threads: int,
                     port: int, draft_max: int = 4, n_gpu_layers: int = 0, flash_attn: bool = True,
                     chat_template: str | None = None) -> list[str]:
    """llama-server with one slot per client (-np N, each slot n_ctx: -c N x n_ctx, no unified
    KV), no prompt cache in RAM, loopback only; with `draft`: draft-model speculation, at most
    `draft_max` drafted tokens, no minimum (as llama-speculative-simple in the anchor)."""
    cmd = [str(bin_dir / "llama-server"), "-m", target, "--host", LOOPBACK, "--port", str(port),
           "-np", str(parallel), "-c", str(parallel * n_ctx), "--no-kv-unified", "-t", str(threads),
           "-tb", str(threads), "-ngl", str(n_gpu_layers), "--cache-ram", "0", "--no-webui", "--seed", "0",
           "-fa", "on" if flash_attn else "off"]
    if chat_template:
        cmd += ["--jinja", "--chat-template-file", chat_template]
    if draft:
        cmd += ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max),
                "--spec-draft-n-min", "0", "-td", str(threads), "-ngld", str(n_gpu_layers)]
    return cmd


def start_llama_server(bin_dir: Path, workdir: Path, name: str, *, timeout: float = 600.0, **kw: Any) -> Process:
    """Start llama-server and wait until GET /health answers 200 (model loaded)."""
    from edgespec.bench.serve_clients import LlamaServerClient

    exe = bin_dir / "llama-server"
    if not exe.is_file():
        raise ServerStartError(f"{exe} not found (build it: tools/llama-anchor.sh build)")
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = llama_server_cmd(bin_dir, port=port, **kw)
    log = workdir / f"{name}-np{kw['parallel']}.log"
    out = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    out.close()
    p = Process(name, proc, f"{LOOPBACK}:{port}", log, cmd)
    client = LlamaServerClient(port, name)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise ServerStartError(f"llama-server exited with {proc.returncode}:\n{p.log_tail()}")
        try:
            if client.health() == 200:
                return p
        except OSError:
            pass
        time.sleep(0.2)
    p.stop(5)
    raise ServerStartError(f"llama-server not healthy after {timeout:.0f} s:\n{p.log_tail()}")
