"""Stopping a daemon the tests started as a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM (the daemon's graceful stop); SIGKILL if it outlives `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_http_daemon(directory: Path, env: dict[str, str], parallel: int,
                      load_timeout: float = 600) -> tuple[subprocess.Popen, str, str]:
    """`edgespec serve` on port 0 with HTTP on port 0, the environment `env` added to the test's
    (its log in directory/serve.log); returns (process, gRPC address, HTTP base URL) once it
    prints SERVING, or fails the test with the log's tail."""
    import pytest

    err = open(directory / "serve.log", "w")  # closed with the process
    proc = subprocess.Popen([sys.executable, "-m", "edgespec.cli.main", "serve", "--port", "0",
                             "--parallel", str(parallel)],
                            cwd=ROOT, env={**os.environ, "EDGESPEC_HTTP_ENABLED": "true", "EDGESPEC_HTTP_PORT": "0",
                                           **env},
                            stdout=subprocess.PIPE, stderr=err, text=True)
    lines: list[str] = []

    def read() -> None:
        while True:
            line = proc.stdout.readline()
            lines.append(line)
            if not line or line.startswith("SERVING "):
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(load_timeout)
    base = next((ln.split()[1] for ln in lines if ln.startswith("HTTP ")), "")
    if not base or not lines[-1].startswith("SERVING "):
        proc.kill()
        pytest.fail(f"daemon did not start: {lines!r}\n{(directory / 'serve.log').read_text()[-3000:]}")
    return proc, lines[-1].split()[1], base
