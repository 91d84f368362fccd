#!/usr/bin/env python3
"""Soak benchmark (not a test): many mixed requests (unary, stream, chat, invalid) with random
cancels and deadlines against a running daemon, or one it starts. Reports throughput, status
counts, the daemon's RSS growth, and that no slot is stuck (active_requests back to 0).

    python tools/soak.py --requests 200 --concurrency 4            # starts `edgespec serve`
    python tools/soak.py --addr 127.0.0.1:50051 --token T          # an existing daemon (no RSS)
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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from edgespec.proto.edgespec.v1 import admin_pb2, admin_pb2_grpc, inference_pb2 as pb, inference_pb2_grpc  # noqa: E402

PROMPTS = ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time", "List three colours:")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def one(stub: inference_pb2_grpc.InferenceStub, rng: random.Random, md: tuple, max_tokens: int) -> str:
    kind = rng.choice(("unary", "stream", "stream", "chat", "invalid", "cancel", "deadline"))
    rq = pb.GenerateRequest()
    if kind == "chat":
        rq.messages.add(role="user", content=rng.choice(PROMPTS))
    else:
        rq.prompt = rng.choice(PROMPTS)
    rq.sampling.max_tokens = rng.randint(1, max_tokens)
    rq.sampling.temperature = rng.choice((0.0, 0.7))
    rq.speculation.mode = rng.choice((pb.AUTO, pb.OFF, pb.CHAIN, pb.TREE))
    if kind == "invalid":
        rq.sampling.temperature = -1.0
    try:
        if kind in ("stream", "cancel"):
            it = stub.GenerateStream(rq, timeout=600, metadata=md)
            for i, _chunk in enumerate(it):
                if kind == "cancel" and i >= rng.randint(0, 3):
                    it.cancel()
                    return "cancelled_by_client"
            return "ok"
        stub.Generate(rq, timeout=rng.uniform(0.2, 2.0) if kind == "deadline" else 600, metadata=md)
        return "ok"
    except grpc.RpcError as exc:
        return exc.code().name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--addr", default="", help="an existing daemon; default: start one")
    ap.add_argument("--token", default="")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the report here too")
    ns = ap.parse_args()
    proc = None
    addr = ns.addr
    if not addr:
        proc = subprocess.Popen([sys.executable, "-m", "edgespec.cli.main", "serve", "--port", "0", "--parallel", "2"],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "EDGESPEC_SERVER_QUEUE_SIZE": "4"})
        line = proc.stdout.readline()
        if not line.startswith("SERVING"):
            print(f"daemon failed to start: {line!r}", file=sys.stderr)
            return 1
        addr = line.split()[1]
    md = (("authorization", f"Bearer {ns.token}"),) if ns.token else ()
    ch = grpc.insecure_channel(addr)
    stub, admin = inference_pb2_grpc.InferenceStub(ch), admin_pb2_grpc.AdminStub(ch)
    rss0 = rss_kib(proc.pid) if proc else 0
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()
    t0 = time.monotonic()
    samples = []

    def task(i: int) -> None:
        out = one(stub, random.Random(ns.seed * 1_000_003 + i), md, ns.max_tokens)
        with lock:
            counts[out] += 1
            if proc and sum(counts.values()) % 25 == 0:
                samples.append(rss_kib(proc.pid))

    with ThreadPoolExecutor(ns.concurrency) as ex:
        list(ex.map(task, range(ns.requests)))
    elapsed = time.monotonic() - t0
    stuck = None
    for _ in range(100):  # cancelled sessions free their slots within a step
        s = admin.Stats(admin_pb2.StatsRequest(), timeout=30, metadata=md)
        stuck = s.active_requests + s.queue_depth
        if stuck == 0:
            break
        time.sleep(0.1)
    report = {
        "requests": ns.requests, "seconds": round(elapsed, 2), "outcomes": dict(counts),
        "stuck_slots": stuck, "generated_tokens_total": s.generated_tokens_total,
        "finished_by_reason": dict(s.finished_by_reason),
    }
    if proc:
        rss1 = rss_kib(proc.pid)
        report |= {"rss_start_mib": round(rss0 / 1024, 1), "rss_end_mib": round(rss1 / 1024, 1),
                   "rss_growth_mib": round((rss1 - rss0) / 1024, 1),
                   "rss_samples_mib": [round(x / 1024, 1) for x in samples]}
        proc.send_signal(signal.SIGTERM)
        report["exit_code"] = proc.wait(60)
    print(json.dumps(report, indent=2))
    if ns.json:
        ns.json.write_text(json.dumps(report, indent=2))
    return 0 if stuck == 0 and "INTERNAL" not in counts else 1


if __name__ == "__main__":
    sys.exit(main())
