"""Idle and slow-header connection floods against a daemon's three listeners (HTTP API, gRPC,
/metrics), with a legitimate caller timed throughout.

Each listener gets `--connections` sockets, half that connect and say nothing, half that send
part of a request and stop (HTTP: a request line and one header, then one more header line every
`--trickle` seconds, a slowloris; gRPC: half of HTTP/2's connection preface). A socket the daemon
closes (its header timeout, idle limits) is opened again at once, so the flood stays at full size
for `--seconds`. Meanwhile, every `--interval` seconds, a legitimate caller with a valid token
runs each check once: HTTP /health, a 2-token completion over HTTP, gRPC health, a 2-token gRPC
Generate and a /metrics scrape. The report gives, per check, how many answered and how many within
2 s (the threat model's goal), the median and the worst seconds; per listener, the sockets
opened again after the daemon closed them.

    python -m edgespec.bench.flood_probe --connections 500 --seconds 60 --json flood.json

It starts `edgespec serve` on loopback (port 0) with the demo models, parallel 2, token auth
and /metrics; the process needs a descriptor limit above 3 x connections (raised to the hard
limit here). The suite runs a small flood (tests/server/test_tenants_e2e.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

# what a slow-header client has sent when it stops: a request line and a header, never the blank
# line that ends them (HTTP), or half of HTTP/2's connection preface (gRPC)
PARTIAL = {"http": b"GET /health HTTP/1.1\r\nHost: localhost\r\n", "grpc": b"PRI * HTTP/2.0\r\n"}
TRICKLE = b"X-Slow: 1\r\n"  # one more header line, now and then (HTTP only: a slowloris)
WITHIN_SECONDS = 2.0  # the goal: /health and a real generate answer within 2 s under the flood


class Flood:
    """`idle` sockets that say nothing and `slow` that send part of a request, to 127.0.0.1:port,
    kept at that number while it runs: a socket the server closes is opened again."""

    def __init__(self, port: int, idle: int, slow: int, kind: str = "http", trickle_seconds: float = 5.0):
        self.port, self.idle, self.slow, self.kind = port, idle, slow, kind
        self.trickle_seconds = trickle_seconds
        self.socks: list[socket.socket | None] = []
        self.reopened = 0  # sockets opened again after the server closed them
        self.failed_opens = 0  # connects the server refused or timed out
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name=f"flood-{port}", daemon=True)

    def _open(self, i: int) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        except OSError:
            self.failed_opens += 1
            return None
        if i >= self.idle:
            with contextlib.suppress(OSError):  # the server may already have closed it
                s.sendall(PARTIAL[self.kind])
        s.setblocking(False)
        return s

    def start(self) -> Flood:
        self.socks = [self._open(i) for i in range(self.idle + self.slow)]
        self._thread.start()
        return self

    def _closed_by_server(self, s: socket.socket) -> bool:
        try:
            return s.recv(4096) == b""  # an answer (a 408, say) is read and dropped; b"": closed
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _keep(self) -> None:
        next_trickle = time.monotonic() + self.trickle_seconds
        while not self._stop.wait(0.2):
            poll = select.poll()  # not select(): a full-size flood's descriptors pass FD_SETSIZE (1,024)
            for s in self.socks:
                if s is not None:
                    poll.register(s, select.POLLIN)
            readable = {fd for fd, _ in poll.poll(0)}
            trickle = self.kind == "http" and time.monotonic() >= next_trickle
            if trickle:
                next_trickle = time.monotonic() + self.trickle_seconds
            for i, s in enumerate(self.socks):
                dead = s is None or (s.fileno() in readable and self._closed_by_server(s))
                if not dead and trickle and i >= self.idle:
                    try:
                        s.send(TRICKLE)  # type: ignore[union-attr]
                    except OSError:
                        dead = True
                if dead and not self._stop.is_set():
                    if s is not None:
                        s.close()
                        self.reopened += 1
                    self.socks[i] = self._open(i)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.socks:
            if s is not None:
                s.close()

    def summary(self) -> dict[str, int]:
        return {"sockets": self.idle + self.slow, "reopened_after_server_close": self.reopened,
                "failed_connects": self.failed_opens}


def probe(checks: Mapping[str, Callable[[], bool]], floods: Mapping[str, Flood], seconds: float,
          interval: float) -> dict[str, Any]:
    """Run every check once per `interval` while the floods are held for `seconds`; a check
    answers when it returns True (an exception or False: it did not)."""
    times: dict[str, list[float]] = {name: [] for name in checks}
    failures: dict[str, list[str]] = {name: [] for name in checks}
    started = [f.start() for f in floods.values()]
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            round_start = time.monotonic()
            for name, check in checks.items():
                t0 = time.monotonic()
                try:
                    ok, why = bool(check()), "answered wrong"
                except Exception as exc:  # a timeout, a refused connection, a status error
                    ok, why = False, f"{type(exc).__name__}: {str(exc)[:120]}"
                if ok:
                    times[name].append(time.monotonic() - t0)
                else:
                    failures[name].append(why)
            time.sleep(max(0.0, interval - (time.monotonic() - round_start)))
    finally:
        for f in started:
            f.stop()
    out: dict[str, Any] = {"seconds": seconds, "interval": interval, "checks": {}, "floods": {}}
    for name in checks:
        t = sorted(times[name])
        out["checks"][name] = {
            "tries": len(t) + len(failures[name]), "answered": len(t),
            "within_2s": sum(x <= WITHIN_SECONDS for x in t),
            "median_seconds": round(statistics.median(t), 4) if t else None,
            "max_seconds": round(t[-1], 4) if t else None, "failures": failures[name][:5]}
    out["floods"] = {kind: f.summary() for kind, f in floods.items()}
    return out


def render(report: Mapping[str, Any]) -> str:
    lines = [f"flood held {report['seconds']:g} s; a legitimate caller's checks every {report['interval']:g} s",
             "", "| check | answered / tries | within 2 s | median s | worst s |", "|---|---|---|---|---|"]
    for name, c in report["checks"].items():
        lines.append(f"| {name} | {c['answered']} / {c['tries']} | {c['within_2s']} | {c['median_seconds']} "
                     f"| {c['max_seconds']} |")
    lines += ["", "| listener | sockets held | reopened after the daemon closed them | failed connects |",
              "|---|---|---|---|"]
    for kind, f in report["floods"].items():
        lines.append(f"| {kind} | {f['sockets']} | {f['reopened_after_server_close']} | {f['failed_connects']} |")
    return "\n".join(lines)


# ---- a daemon on the demo models, and the legitimate caller's checks ---------------------------


@contextlib.contextmanager
def demo_daemon(workdir: Path, user: str, admin: str, load_timeout: float = 900) -> Iterator[dict[str, Any]]:
    """`edgespec serve` on loopback with the demo models, HTTP and /metrics on, token auth;
    yields its addresses {"grpc", "http", "metrics_port"}."""
    from edgespec.bench.serve_systems import free_port
    from edgespec.server.auth import hash_token

    (workdir / "tokens").write_text(f"caller:{hash_token(user)}\n")
    (workdir / "admin_tokens").write_text(f"ops:{hash_token(admin)}\n")
    metrics_port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("EDGESPEC_") or k == "EDGESPEC_HOME"},
           "EDGESPEC_HTTP_ENABLED": "true", "EDGESPEC_HTTP_PORT": "0", "EDGESPEC_TARGET_N_CTX": "1024",
           "EDGESPEC_DRAFT_N_CTX": "1024", "EDGESPEC_SERVER_GRACE_SECONDS": "5",
           "EDGESPEC_AUTH_TOKENS_FILE": str(workdir / "tokens"),
           "EDGESPEC_AUTH_ADMIN_TOKENS_FILE": str(workdir / "admin_tokens"), "EDGESPEC_METRICS_ENABLED": "true",
           "EDGESPEC_METRICS_PORT": str(metrics_port), "EDGESPEC_LOGGING_LEVEL": "warning"}
    with open(workdir / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "edgespec.cli.main", "serve", "--port", "0", "--parallel", "2"],
                                env=env, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
        reader.start()
        deadline = time.monotonic() + load_timeout
        while not any(ln.startswith("SERVING ") for ln in lines):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"edgespec serve did not start: {(workdir / 'serve.log').read_text()[-2000:]}")
            time.sleep(0.2)
        http = next(ln.split()[1] for ln in lines if ln.startswith("HTTP "))
        grpc_addr = next(ln.split()[1] for ln in lines if ln.startswith("SERVING "))
        yield {"grpc": grpc_addr, "http": http, "metrics_port": metrics_port}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def caller_checks(addrs: Mapping[str, Any], user: str, admin: str, model: str,
                  timeout: float = 10.0) -> dict[str, Callable[[], bool]]:
    """A legitimate caller's requests (each on a fresh connection, as a new client's would be)."""
    import grpc
    import httpx
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from edgespec.proto.edgespec.v1 import inference_pb2 as pb
    from edgespec.proto.edgespec.v1 import inference_pb2_grpc

    bearer = {"authorization": f"Bearer {user}"}
    md = (("authorization", f"Bearer {user}"),)

    def grpc_call(fn: Callable[[grpc.Channel], bool]) -> bool:
        with grpc.insecure_channel(addrs["grpc"]) as ch:
            return fn(ch)

    def generate(ch: grpc.Channel) -> bool:
        rq = pb.GenerateRequest(prompt="The capital of France is")
        rq.sampling.max_tokens = 2
        return inference_pb2_grpc.InferenceStub(ch).Generate(rq, timeout=timeout, metadata=md).usage.completion_tokens == 2

    return {
        "http /health": lambda: httpx.get(f"{addrs['http']}/health", timeout=timeout).status_code == 200,
        "http completion (2 tokens)": lambda: httpx.post(
            f"{addrs['http']}/v1/completions", headers=bearer, timeout=timeout,
            json={"model": model, "prompt": "The capital of France is", "max_tokens": 2}).status_code == 200,
        "grpc health": lambda: grpc_call(lambda ch: health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout).status == health_pb2.HealthCheckResponse.SERVING),
        "grpc Generate (2 tokens)": lambda: grpc_call(generate),
        "/metrics scrape": lambda: httpx.get(f"http://127.0.0.1:{addrs['metrics_port']}/metrics",
                                             headers={"authorization": f"Bearer {admin}"},
                                             timeout=timeout).status_code == 200,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=500, help="sockets per listener (half idle, half slow)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between the caller's rounds of checks")
    ap.add_argument("--trickle", type=float, default=5.0, help="seconds between a slow HTTP socket's header lines")
    ap.add_argument("--json", type=Path, help="write the report here too")
    args = ap.parse_args(argv)
    from edgespec.server.config import DEMO_TARGET

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 3 * args.connections + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))  # the daemon inherits it
    user, admin = "flood-caller-secret", "flood-admin-secret"
    half = args.connections // 2
    with tempfile.TemporaryDirectory() as tmp, demo_daemon(Path(tmp), user, admin) as addrs:
        model = DEMO_TARGET.removesuffix(".gguf")
        for check in caller_checks(addrs, user, admin, model, timeout=300).values():
            with contextlib.suppress(Exception):  # warm: a process's first requests are not what is timed
                check()
        checks = caller_checks(addrs, user, admin, model)
        floods = {
            "http": Flood(int(addrs["http"].rsplit(":", 1)[1]), args.connections - half, half, "http", args.trickle),
            "grpc": Flood(int(addrs["grpc"].rsplit(":", 1)[1]), args.connections - half, half, "grpc"),
            "metrics": Flood(addrs["metrics_port"], args.connections - half, half, "http", args.trickle),
        }
        report = probe(checks, floods, args.seconds, args.interval)
    report["connections_per_listener"] = args.connections
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    ok = all(c["within_2s"] == c["tries"] for c in report["checks"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
