"""A target larger than one box: llama.cpp's RPC backend. A real `rpc-server` on loopback holds
the target's layers ([target] rpc_servers, n_gpu_layers = -1) behind a real daemon; its greedy
output equals the local target's. Needs the wheel built with RPC=1 and tools/build-rpc-server.sh's
binary (skipped otherwise, saying which is missing)."""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgespec.config import models_dir
from edgespec.server.config import DEMO_DRAFT, DEMO_TARGET

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _rpc_server_binary() -> str | None:
    if os.environ.get("EDGESPEC_RPC_SERVER"):
        return os.environ["EDGESPEC_RPC_SERVER"]
    found = sorted(glob.glob(str(Path.home() / ".cache/edgespec/rpc-server/*/rpc-server")))
    return found[0] if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_rpc_server_is_a_clear_error_not_an_abort(tmp_path):
    from edgespec import backend
    from edgespec.errors import ModelError

    if not backend.has_rpc():
        pytest.skip("this wheel has no RPC backend (make install RPC=1)")
    with pytest.raises(ModelError, match="target.rpc_servers: cannot reach the rpc-server at 127.0.0.1:"):
        backend.add_rpc_servers([f"127.0.0.1:{_free_port()}"])


def test_a_target_on_an_rpc_server_answers_like_the_local_one(tmp_path):
    from edgespec import backend

    if not backend.has_rpc():
        pytest.skip("this wheel has no RPC backend (make install RPC=1)")
    exe = _rpc_server_binary()
    if exe is None:
        pytest.skip("no rpc-server binary (make rpc-server, or EDGESPEC_RPC_SERVER=PATH)")
    target, draft = models_dir() / DEMO_TARGET, models_dir() / DEMO_DRAFT
    if not (target.is_file() and draft.is_file()):
        pytest.skip("demo models missing: run `edgespec models prepare-demo`")
    port = _free_port()
    rpc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port), "-t", "2"], stdout=subprocess.DEVNULL,
                           stderr=open(tmp_path / "rpc.log", "w"))
    try:
        deadline = time.monotonic() + 60
        while True:  # wait until it listens (a condition, not a guessed delay)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert rpc.poll() is None and time.monotonic() < deadline, (tmp_path / "rpc.log").read_text()
                time.sleep(0.1)
        prompt = "Write a Python function that reverses a list."
        local = subprocess.run([sys.executable, "-m", "edgespec.cli.main", "generate", prompt, "--raw", "--mode", "plain",
                                "--temperature", "0", "--max-tokens", "16", "--n-ctx", "512"], capture_output=True, text=True, cwd=ROOT,
                               timeout=600)
        assert local.returncode == 0, local.stderr[-2000:]
        cfg = tmp_path / "edgespec.toml"
        cfg.write_text(f'[target]\nn_gpu_layers = -1\nn_ctx = 512\nrpc_servers = ["127.0.0.1:{port}"]\n'
                       '[draft]\nn_ctx = 512\n[server]\nport = 0\nparallel = 1\n')
        env = {**os.environ, "EDGESPEC_LOG_LEVEL": "info"}
        serve = subprocess.Popen([sys.executable, "-m", "edgespec.cli.main", "serve", "--config", str(cfg),
                                  "--log-level", "info"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=open(tmp_path / "serve.log", "w"), text=True)
        try:
            line = serve.stdout.readline()
            assert line.startswith("SERVING "), (tmp_path / "serve.log").read_text()[-3000:]
            out = subprocess.run([sys.executable, "-m", "edgespec.cli.main", "client", "generate", prompt,
                                  "--mode", "off", "--temperature", "0", "--max-tokens", "16",
                                  "--addr", line.split()[1]],
                                 capture_output=True, text=True, cwd=ROOT, timeout=600)
            assert out.returncode == 0, out.stderr[-2000:]
            log = (tmp_path / "serve.log").read_text()
            assert '"event": "rpc_servers"' in log and f"127.0.0.1:{port}" in log
            assert out.stdout.strip() == local.stdout.strip()  # the same greedy text, computed over RPC
        finally:
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)
    finally:
        rpc.send_signal(signal.SIGTERM)
        try:
            rpc.wait(10)
        except subprocess.TimeoutExpired:
            rpc.kill()
            rpc.wait()
