"""End to end: two identities (alice's and bob's bearer tokens) against `edgespec serve` as a real
process on the demo models, over gRPC and the HTTP API on loopback. Bob reads nothing of a prefix
only alice sent (cached_tokens and draft_cached_tokens 0, while alice gets her reuse), whether
alice's request is running or done and the draft has absorbed it while idle; and floods of idle
and slow-header sockets against all three listeners leave /health and a real generate request
answering. A servicer that dropped the caller would fail here. Slow: CI runs it."""

from __future__ import annotations

import resource
import socket
import subprocess
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgespec.config import models_dir
from edgespec.proto.edgespec.v1 import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.server.auth import hash_token
from edgespec.server.config import DEMO_DRAFT, DEMO_TARGET
from tests.server.floods import flood, timed
from tests.server.processes import start_http_daemon, stop

pytestmark = pytest.mark.slow
LOAD_TIMEOUT = 600
TOKENS = {"alice": "alice-secret", "bob": "bob-secret"}
ADMIN = "ops-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, addr: str, http: str, metrics_port: int):
        self.proc, self.addr, self.http, self.metrics_port = proc, addr, http, metrics_port
        self.channel = grpc.insecure_channel(addr)
        self.inference = inference_pb2_grpc.InferenceStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    @staticmethod
    def md(who: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {TOKENS.get(who, ADMIN)}"),)

    def wait_idle(self) -> None:
        """Until the engine has nothing left to do (the draft has absorbed the last context)."""
        deadline = time.monotonic() + 120
        while not self.admin.Stats(admin_pb2.StatsRequest(), timeout=30, metadata=self.md("ops")).idle:
            assert time.monotonic() < deadline
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    if not ((models_dir() / DEMO_TARGET).is_file() and (models_dir() / DEMO_DRAFT).is_file()):
        pytest.skip("demo models missing: run `edgespec models prepare-demo`")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096 <= hard:  # the floods hold ~1,000 sockets here and as many in the daemon
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
    d = tmp_path_factory.mktemp("tenants")
    (d / "tokens").write_text("".join(f"{name}:{hash_token(t)}\n" for name, t in TOKENS.items()))
    (d / "admin_tokens").write_text(f"ops:{hash_token(ADMIN)}\n")
    metrics_port = _free_port()
    proc, addr, base = start_http_daemon(d, {
        "EDGESPEC_SERVER_GRACE_SECONDS": "5", "EDGESPEC_TARGET_N_CTX": "1024", "EDGESPEC_DRAFT_N_CTX": "1024",
        "EDGESPEC_SERVER_QUEUE_SIZE": "4", "EDGESPEC_AUTH_TOKENS_FILE": str(d / "tokens"),
        "EDGESPEC_AUTH_ADMIN_TOKENS_FILE": str(d / "admin_tokens"), "EDGESPEC_METRICS_ENABLED": "true",
        "EDGESPEC_METRICS_PORT": str(metrics_port)}, parallel=2, load_timeout=LOAD_TIMEOUT)
    s = Server(proc, addr, base, metrics_port)
    yield s
    s.channel.close()
    stop(proc)


def _secret(topic: str) -> str:
    """A long confidential prefix (~650 tokens) that starts with its topic: different topics share
    no leading token, so bob's own earlier probes give him nothing to reuse on a later one."""
    return f"{topic}: CONFIDENTIAL MEMO. " + " ".join(
        f"{topic} item {i}: account {1000 + 37 * i} owes {(13 * i) % 97} units to branch {i % 11}." for i in range(28))


def _grpc(server: Server, who: str, prompt: str, max_tokens: int = 2) -> tuple[int, int, int]:
    rq = pb.GenerateRequest(prompt=prompt)
    rq.sampling.max_tokens = max_tokens
    r = server.inference.Generate(rq, timeout=300, metadata=server.md(who))
    return r.usage.prompt_tokens, r.usage.cached_prompt_tokens, r.usage.draft_cached_tokens


def _http(server: Server, who: str, prompt: str, max_tokens: int = 2) -> tuple[int, int, int]:
    r = httpx.post(f"{server.http}/v1/completions", timeout=300,
                   headers={"authorization": f"Bearer {TOKENS[who]}"},
                   json={"model": DEMO_TARGET.removesuffix(".gguf"), "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return (body["usage"]["prompt_tokens"], body["usage"]["prompt_tokens_details"]["cached_tokens"],
            body["edgespec"]["draft_cached_tokens"])


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_bob_reads_nothing_of_a_prefix_only_alice_sent(server, api):
    send = _grpc if api == "grpc" else _http
    secret, live = (_secret("Amber"), _secret("Basil")) if api == "grpc" else (_secret("Cedar"), _secret("Dune"))
    n, cached, _ = send(server, "alice", secret + "\nQ: who owes most?", max_tokens=8)
    assert n > 600 and cached == 0
    server.wait_idle()  # her slot keeps the prefill, and the draft absorbed her prompt and reply
    # bob's guess at her prefix, after her request: nothing reused, nothing counted (one guess:
    # a second would share the prefix with bob's own first, which is his to reuse)
    assert send(server, "bob", secret + "\nQ: summary?")[1:] == (0, 0)
    # alice herself still gets her reuse (the counters work, and bob did not evict her)
    n2, cached, draft_cached = send(server, "alice", secret + "\nQ: summary?")
    assert cached > 500 and draft_cached > 0

    # while her long request runs (its prompt read: the slot publishes its prefill), bob probes again
    rq = pb.GenerateRequest(prompt=live + "\nQ: list every account.")
    rq.sampling.max_tokens = 300
    stream = server.inference.GenerateStream(rq, timeout=300, metadata=server.md("alice"))
    try:
        next(stream)
        assert send(server, "bob", live + "\nQ: total?")[1:] == (0, 0)
        assert send(server, "alice", live + "\nQ: total?")[1] > 500
    finally:
        stream.cancel()


def test_idle_and_slow_header_floods_leave_health_and_a_real_generate_answering(server):
    """300 sockets on each listener (half idle, half stopped mid-headers): over HTTP and gRPC,
    /health and a short generate on the demo models answer within 2 s, again and again while they
    are held, and /metrics serves a scrape."""
    http_port = int(server.http.rsplit(":", 1)[1])
    grpc_port = int(server.addr.rsplit(":", 1)[1])
    rq = pb.GenerateRequest(prompt="The capital of France is")
    rq.sampling.max_tokens = 2
    bearer = {"authorization": f"Bearer {TOKENS['alice']}"}
    admin = {"authorization": f"Bearer {ADMIN}"}  # /metrics: a metrics or admin token
    checks = {
        "http /health": lambda: httpx.get(f"{server.http}/health", timeout=2).status_code,
        "http completion": lambda: httpx.post(
            f"{server.http}/v1/completions", headers=bearer, timeout=2,
            json={"model": DEMO_TARGET.removesuffix(".gguf"), "prompt": "The capital of France is",
                  "max_tokens": 2}).status_code,
        "grpc health": lambda: 200 if server.health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
        == health_pb2.HealthCheckResponse.SERVING else 503,
        "grpc generate": lambda: 200 if server.inference.Generate(rq, timeout=2, metadata=server.md("alice"))
        .usage.completion_tokens == 2 else 500,
        "/metrics": lambda: httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", headers=admin,
                                      timeout=2).status_code,
    }
    with flood(http_port, 150, 150, "http"), flood(grpc_port, 150, 150, "grpc"), \
            flood(server.metrics_port, 150, 150, "http"):
        for _ in range(3):
            for name, check in checks.items():
                seconds, status = timed(check)
                assert status == 200 and seconds < 2, f"{name}: {status} in {seconds:.2f} s"
