#!/usr/bin/env python3
"""Seeded fuzzer for the daemon: random and mutated requests from hostile callers.

Sends valid protobuf with random field values (every RPC of Inference, Admin and Health), raw
mutated bytes through a generic channel call, and random metadata (no token, wrong tokens, user
and admin tokens, odd keys), from several threads at once, after opening more anonymous Watch
streams than limits.anonymous_rpcs allows. Fails (exit 1) on:

- any INTERNAL, UNKNOWN or DATA_LOSS status (a hostile caller must get a domain error),
- the daemon exiting (a crash), or exiting non-zero on SIGTERM at the end,
- an authorised Generate refused while the anonymous Watch streams are open,
- health not SERVING, or a plain authorised Generate not answered, after the fuzzing,
- the daemon's RSS growing more than --rss-growth-mib over the run.

    python tools/fuzz.py --serve --requests 300 --seed 1      # the test suite's short run (tests/server/test_fuzz.py)
    python tools/fuzz.py --serve --requests 5000 --seed 7     # the long run, ~10-20 min on 2 cores
    python tools/fuzz.py --addr HOST:PORT --token T --admin-token A   # an existing daemon (no RSS check)

With --serve it starts `edgespec serve` on 127.0.0.1 (port 0) with the demo models, token auth (a
user and an admin token it makes), n_ctx 1024, max_tokens 32, parallel 2, queue_size 4. The
report (JSON on stdout) counts every (RPC, status) pair; the same seed sends the same requests.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from edgespec.proto.edgespec.v1 import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from edgespec.proto.edgespec.v1 import inference_pb2 as pb

FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}
USER_TOKEN, ADMIN_TOKEN = "fuzz-user-token", "fuzz-admin-token"

# interesting values per field: (valid ones, invalid ones); an invalid one is picked 1 time in 8
TEMPERATURES = ((0.0, 5e-324, 1e-310, 1e-6, 1e-5, 0.05, 0.7, 1.0, 100.0), (100.5, -1.0, float("nan"), float("inf")))
TOP_K = ((0, 1, 40, 49152, 2**31 - 1), (-1, -(2**31)))
TOP_P = ((1e-12, 0.5, 0.95, 1.0), (0.0, 1.5, -0.1, float("nan")))
MIN_P = ((0.0, 0.05, 0.999), (1.0, -1.0, float("nan")))
SEEDS = ((0, 1, 2**63 - 1), (-1, -(2**63)))
MAX_TOKENS = ((1, 2, 8, 16, 32), (-5, 0, 33, 4096, 2**31 - 1))
SPEC_INTS = ((1, 4, 16), (-1, 0, 17, 64, 65, 2**31 - 1))
MODES = ((pb.AUTO, pb.OFF, pb.CHAIN, pb.TREE), (4, 99, -3))
ROLES = (("system", "user", "assistant", "tool"), ("", "root", "USER", "user\x00", "系统"))
REQUEST_IDS = (("", "ok-1", "Req_1.2:3", "x" * 128, "-"), ("请求٣", "a b", "x" * 129, "\t", "caf\u00e9"))


def pick(rng: random.Random, values: tuple[tuple, tuple]) -> Any:
    return rng.choice(values[1] if rng.random() < 1 / 8 else values[0])


PIECES = ("hi", " ", "\n", "\t", "\x00", "é", "请求", "٣", "🙂", "<|im_start|>", "<|im_end|>", "system\n",
          "You are root.", "<|endoftext|>", "</s>", "<s>", "\ufffd", "\ud7ff", "a" * 300, "word " * 50,
          "{{ messages }}", "{% raw %}", "\\u0000", "%s%n", "' OR 1=1 --")


def text(rng: random.Random, max_pieces: int = 12) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, max_pieces)))


def maybe(rng: random.Random, p: float = 0.5) -> bool:
    return rng.random() < p


def sampling(rng: random.Random, s: pb.SamplingOptions) -> None:
    for name, values in (("temperature", TEMPERATURES), ("top_k", TOP_K), ("top_p", TOP_P), ("min_p", MIN_P),
                         ("seed", SEEDS), ("max_tokens", MAX_TOKENS)):
        if maybe(rng, 0.4 if name != "max_tokens" else 0.8):
            setattr(s, name, pick(rng, values))
    if maybe(rng, 0.3):
        s.stop.extend(text(rng, 3) or "." for _ in range(rng.choice((0, 1, 2, 16, 17, 40) if maybe(rng, 0.2) else (1, 2))))


def speculation(rng: random.Random, s: pb.SpeculationOptions) -> None:
    s.mode = pick(rng, MODES)
    for name in ("draft_tokens", "tree_nodes", "tree_depth"):
        if maybe(rng, 0.3):
            setattr(s, name, pick(rng, SPEC_INTS))
    if maybe(rng, 0.3):
        s.ngram = maybe(rng)


def messages(rng: random.Random, into) -> None:
    n = rng.choice((1, 1, 2, 3, 8, 40, 1025 if maybe(rng, 0.05) else 4))
    for _ in range(n):
        into.add(role=pick(rng, ROLES) if maybe(rng, 0.3) else "user", content=text(rng))


def generate_request(rng: random.Random) -> pb.GenerateRequest:
    rq = pb.GenerateRequest()
    shape = rng.random()  # a prompt, messages, both (invalid) or neither (invalid)
    if shape < 0.5 or 0.9 <= shape < 0.95:
        rq.prompt = text(rng) or "x"
    if 0.5 <= shape < 0.95:
        messages(rng, rq.messages)
    if maybe(rng, 0.03):
        rq.prompt = "w" * rng.choice((1 << 20, (1 << 20) + 1))
    sampling(rng, rq.sampling)
    speculation(rng, rq.speculation)
    if maybe(rng, 0.4):
        rq.request_id = pick(rng, REQUEST_IDS)
    return rq


def tokenize_request(rng: random.Random) -> pb.TokenizeRequest:
    rq = pb.TokenizeRequest(add_special=maybe(rng), parse_special=maybe(rng))
    if maybe(rng, 0.6):
        rq.text = text(rng, 30)
    if maybe(rng, 0.4):
        messages(rng, rq.messages)
    return rq


def set_policy_request(rng: random.Random) -> admin_pb2.SetPolicyRequest:
    policy: Any = rng.choice((0, 1, 2, 3, 77))  # 77: no such enum value, on purpose
    rq = admin_pb2.SetPolicyRequest(speculation=policy, reset=maybe(rng, 0.3))
    for name in ("max_draft_tokens", "max_tree_nodes", "max_tree_depth", "max_tokens"):
        if maybe(rng, 0.3):
            setattr(rq, name, rng.choice(SPEC_INTS[0] + SPEC_INTS[1] + (32, 4096, 1 << 20, (1 << 20) + 1)))
    return rq


# (full method name, request maker, response streaming)
METHODS: list[tuple[str, Callable[[random.Random], object], bool]] = [
    ("/edgespec.v1.Inference/Generate", generate_request, False),
    ("/edgespec.v1.Inference/Generate", generate_request, False),
    ("/edgespec.v1.Inference/GenerateStream", generate_request, True),
    ("/edgespec.v1.Inference/Tokenize", tokenize_request, False),
    ("/edgespec.v1.Inference/ModelInfo", lambda rng: pb.ModelInfoRequest(), False),
    ("/edgespec.v1.Admin/Stats", lambda rng: admin_pb2.StatsRequest(), False),
    ("/edgespec.v1.Admin/SetPolicy", set_policy_request, False),
    ("/edgespec.v1.Admin/Drain", lambda rng: admin_pb2.DrainRequest(resume=maybe(rng, 0.7)), False),
    ("/grpc.health.v1.Health/Check", lambda rng: health_pb2.HealthCheckRequest(service=rng.choice(
        ("", "edgespec.v1.Inference", "edgespec.v1.Admin", "nope", text(rng, 2)))), False),
    ("/grpc.health.v1.Health/Watch", lambda rng: health_pb2.HealthCheckRequest(), True),
]


def metadata(rng: random.Random) -> tuple[tuple[str, str | bytes], ...]:
    if maybe(rng, 0.55):  # an authorised caller (sending hostile requests)
        auth: str | None = f"Bearer {ADMIN_TOKEN if maybe(rng, 0.25) else USER_TOKEN}"
    else:
        auth = rng.choice((None, None, "Bearer", "Bearer ", "bearer " + USER_TOKEN, USER_TOKEN, "Basic Zm9vOmJhcg==",
                           "Bearer " + "x" * 4000, f"Bearer {USER_TOKEN} extra", f"Bearer {USER_TOKEN[:-1]}"))
    md: list[tuple[str, str | bytes]] = []
    if auth is not None:
        md.append(("authorization", auth))
    if maybe(rng, 0.3):
        md.append(("x-request-id", rng.choice(("abc", "x" * 500, "..", "%00"))))
    if maybe(rng, 0.1):
        md.append(("x-fuzz-bin", bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))))
    if maybe(rng, 0.1):
        md.append(("authorization", f"Bearer {ADMIN_TOKEN}"))  # a second, conflicting header
    return tuple(md)


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        op = rng.randrange(6)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1:
            b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
        elif op == 2 and b:
            del b[rng.randrange(len(b))]
        elif op == 3 and b:
            del b[rng.randrange(len(b)):]
        elif op == 4:
            b[rng.randrange(len(b) + 1):rng.randrange(len(b) + 1)] = bytes(rng.randrange(256) for _ in range(8))
        else:  # a string field with invalid UTF-8
            field = rng.choice((0x0A, 0x12, 0x1A, 0x2A))
            b += bytes((field, 2, 0xFF, 0xFE))
    return bytes(b)


class Fuzzer:
    def __init__(self, addr: str, seed: int, deadline: float):
        self.addr, self.seed, self.deadline = addr, seed, deadline
        self.channel = grpc.insecure_channel(addr)
        self.counts: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, str] = {}  # (RPC, status) -> the first status details seen
        self.violations: list[str] = []
        self.lock = threading.Lock()

    def record(self, name: str, code: grpc.StatusCode, what: str, details: str = "") -> None:
        with self.lock:
            self.counts[f"{name} {code.name}"] += 1
            self.examples.setdefault(f"{name} {code.name}", details[:160])
            if code in FORBIDDEN:
                self.violations.append(f"{name}: {code.name} for {what}")

    def one(self, i: int) -> None:
        rng = random.Random(self.seed * 1_000_003 + i)
        method, make, streaming = rng.choice(METHODS)
        request = make(rng)
        raw = request.SerializeToString()  # type: ignore[attr-defined]
        mutated = maybe(rng, 0.3)
        if mutated:
            raw = mutate(rng, raw)
        md = metadata(rng)
        name = method.rsplit("/", 1)[-1] + (" (mutated)" if mutated else "")
        identity = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
        timeout = rng.uniform(0.5, self.deadline)
        try:
            if streaming:
                call = self.channel.unary_stream(method, **identity)(raw, timeout=timeout, metadata=md)
                for n, _ in enumerate(call):
                    if method.endswith("Watch") or (n >= 2 and maybe(rng, 0.3)):
                        call.cancel()  # watches would run forever; some streams are dropped mid-way
                        break
            else:
                self.channel.unary_unary(method, **identity)(raw, timeout=timeout, metadata=md)
                if method.endswith("/Drain"):  # whatever it asked: accept requests again
                    admin_pb2_grpc.AdminStub(self.channel).Drain(admin_pb2.DrainRequest(resume=True), timeout=30,
                                                                 metadata=user_md(ADMIN_TOKEN))
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code is grpc.StatusCode.CANCELLED and streaming:
                code = grpc.StatusCode.OK  # we cancelled it
        self.record(name, code, f"request {i} (seed {self.seed}): {raw[:120]!r} metadata {md!r}", details)


def user_md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def watch_flood(fz: Fuzzer, n: int, user: str) -> dict:
    """n anonymous Watch streams held open; an authorised Generate must still be served."""
    stub = health_pb2_grpc.HealthStub(fz.channel)
    calls = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=120) for _ in range(n)]
    held = refused = 0
    for c in calls:
        try:
            next(c)
            held += 1
        except grpc.RpcError as exc:
            refused += 1
            fz.record("Watch (flood)", exc.code(), "an anonymous Watch")
    rq = pb.GenerateRequest(prompt="The capital of France is")
    rq.sampling.max_tokens = 4
    try:
        inference_pb2_grpc.InferenceStub(fz.channel).Generate(rq, timeout=120, metadata=user_md(user))
        served = True
    except grpc.RpcError as exc:
        served = False
        fz.violations.append(f"authorised Generate refused during the Watch flood: {exc.code().name} {exc.details()}")
    for c in calls:
        c.cancel()
    return {"opened": n, "held": held, "refused": refused, "authorised_generate_served": served}


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def start_daemon(tmp: Path) -> tuple[subprocess.Popen, str]:
    from edgespec.server.auth import hash_token

    (tmp / "tokens").write_text(hash_token(USER_TOKEN) + "\n")
    (tmp / "admin_tokens").write_text(hash_token(ADMIN_TOKEN) + "\n")
    (tmp / "edgespec.toml").write_text(
        "[server]\nport = 0\nparallel = 2\nqueue_size = 4\nmax_tokens = 32\ndefault_max_tokens = 16\n"
        "grace_seconds = 5\n[target]\nn_ctx = 1024\n[draft]\nn_ctx = 1024\n"
        f'[auth]\ntokens_file = "{tmp / "tokens"}"\nadmin_tokens_file = "{tmp / "admin_tokens"}"\n')
    log = open(tmp / "serve.log", "w")  # lives as long as the daemon
    proc = subprocess.Popen([sys.executable, "-m", "edgespec.cli.main", "serve", "--config", str(tmp / "edgespec.toml"),
                             "--log-level", "warning"], cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={k: v for k, v in os.environ.items() if not k.startswith("EDGESPEC_") or k == "EDGESPEC_HOME"})
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("SERVING "):
        proc.kill()
        raise SystemExit(f"the daemon did not start: {line!r}\n{(tmp / 'serve.log').read_text()[-3000:]}")
    return proc, line.split()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", action="store_true", help="start a daemon with the demo models (default without --addr)")
    ap.add_argument("--addr", default="", help="an existing daemon")
    ap.add_argument("--token", default="", help="a user token of the existing daemon")
    ap.add_argument("--admin-token", default="", help="an admin token of the existing daemon")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--deadline", type=float, default=10.0, help="longest per-call deadline, seconds")
    ap.add_argument("--watch-flood", type=int, default=40, help="anonymous Watch streams opened at the start")
    ap.add_argument("--rss-growth-mib", type=float, default=256.0)
    ns = ap.parse_args()
    global USER_TOKEN, ADMIN_TOKEN  # an existing daemon's tokens
    if ns.token:
        USER_TOKEN = ns.token
    if ns.admin_token:
        ADMIN_TOKEN = ns.admin_token
    tmp = tempfile.TemporaryDirectory(prefix="edgespec-fuzz-")
    proc = None
    addr = ns.addr
    if not addr:
        proc, addr = start_daemon(Path(tmp.name))
    fz = Fuzzer(addr, ns.seed, ns.deadline)
    report: dict = {"seed": ns.seed, "requests": ns.requests, "address": addr}
    try:
        report["watch_flood"] = watch_flood(fz, ns.watch_flood, USER_TOKEN)
        rss0 = rss_kib(proc.pid) if proc else 0
        t0 = time.monotonic()
        with ThreadPoolExecutor(ns.concurrency) as ex:
            for i, f in enumerate([ex.submit(fz.one, i) for i in range(ns.requests)]):
                f.result()
                if proc is not None and proc.poll() is not None:
                    fz.violations.append(f"the daemon exited ({proc.returncode}) during request {i}")
                    break
        report["seconds"] = round(time.monotonic() - t0, 1)
        admin_md = user_md(ADMIN_TOKEN)
        admin = admin_pb2_grpc.AdminStub(fz.channel)
        admin.Drain(admin_pb2.DrainRequest(resume=True), timeout=30, metadata=admin_md)
        admin.SetPolicy(admin_pb2.SetPolicyRequest(reset=True), timeout=30, metadata=admin_md)
        st = admin.Stats(admin_pb2.StatsRequest(), timeout=30, metadata=admin_md)
        report["engine"] = {"requests_total": st.requests_total, "finished_by_reason": dict(st.finished_by_reason),
                            "generated_tokens_total": st.generated_tokens_total,
                            "rejected_overloaded_total": st.rejected_overloaded_total}
        status = health_pb2_grpc.HealthStub(fz.channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status
        report["health_after"] = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        if status != health_pb2.HealthCheckResponse.SERVING:
            fz.violations.append(f"health after the run: {report['health_after']}")
        rq = pb.GenerateRequest(prompt="1, 2, 3, 4,")
        rq.sampling.max_tokens = 8
        try:
            out = inference_pb2_grpc.InferenceStub(fz.channel).Generate(rq, timeout=120, metadata=user_md(USER_TOKEN))
            report["normal_request_after"] = {"completion_tokens": out.usage.completion_tokens}
        except grpc.RpcError as exc:
            fz.violations.append(f"a normal request after the run: {exc.code().name} {exc.details()}")
        if proc is not None:
            rss1 = rss_kib(proc.pid)
            report |= {"rss_start_mib": round(rss0 / 1024, 1), "rss_end_mib": round(rss1 / 1024, 1),
                       "rss_growth_mib": round((rss1 - rss0) / 1024, 1)}
            if (rss1 - rss0) / 1024 > ns.rss_growth_mib:
                fz.violations.append(f"RSS grew {report['rss_growth_mib']} MiB (limit {ns.rss_growth_mib})")
    finally:
        fz.channel.close()
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    report["exit_code"] = proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    report["exit_code"] = "killed after 60 s"
            else:
                report["exit_code"] = proc.returncode
            if report["exit_code"] != 0:
                fz.violations.append(f"daemon exit code {report['exit_code']}")
                report["serve_log_tail"] = (Path(tmp.name) / "serve.log").read_text()[-3000:]
        tmp.cleanup()
    report["statuses"] = dict(sorted(fz.counts.items()))
    report["examples"] = dict(sorted(fz.examples.items()))
    report["violations"] = fz.violations[:50]
    print(json.dumps(report, indent=2))
    return 1 if fz.violations else 0


if __name__ == "__main__":
    sys.exit(main())
