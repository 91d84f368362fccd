#!/usr/bin/env python3
"""The deadline probe: a lone ~2,800-token prompt with a 0.2 s deadline, and a small request sent
right behind it. Reports how long after the deadline the small request got its first token
(the engine must drop the long prompt's forward at once, not finish its n_batch piece), with and
without a CPU-bound busy-loop process beside the daemon (`--busy`). Several trials, one process.

usage: .venv/bin/python tools/deadline-probe.py [--trials 5] [--busy] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgespec.bench.serve_systems import daemon_sections, start_daemon  # noqa: E402


def _spin() -> None:
    while True:
        pass


def main() -> int:
    import grpc

    from edgespec.config import models_dir
    from edgespec.proto.edgespec.v1 import inference_pb2 as pb, inference_pb2_grpc
    from edgespec.server.config import DEMO_TARGET

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--busy", action="store_true", help="a busy-loop process beside the daemon")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=0.2)
    a = ap.parse_args()
    sections = daemon_sections(target=str(models_dir() / DEMO_TARGET), draft=None, parallel=1, n_ctx=4096,
                               threads=a.threads, max_tokens=8)
    p = start_daemon(Path(tempfile.mkdtemp(prefix="deadline-")), sections)
    busy = multiprocessing.Process(target=_spin, daemon=True) if a.busy else None
    if busy:
        busy.start()
    gaps, codes = [], []
    try:
        with grpc.insecure_channel(p.addr) as ch:
            stub = inference_pb2_grpc.InferenceStub(ch)
            small = pb.GenerateRequest(prompt="The capital of France is", sampling=pb.SamplingOptions(max_tokens=2))
            stub.Generate(small, timeout=120)  # warm
            for trial in range(a.trials):
                long = pb.GenerateRequest(prompt=f"Record {trial}. " + "The quick brown fox jumps over the lazy dog. " * 280,
                                          sampling=pb.SamplingOptions(max_tokens=4))
                box = []

                def run_long() -> None:
                    try:
                        stub.Generate(long, timeout=a.deadline)
                        box.append("OK")
                    except grpc.RpcError as exc:
                        box.append(exc.code().name)

                t0 = time.monotonic()
                th = threading.Thread(target=run_long)
                th.start()
                time.sleep(0.05)  # the long prompt is in the engine first
                first = None
                for chunk in stub.GenerateStream(small, timeout=120):
                    if chunk.token_ids:
                        first = time.monotonic()
                        break
                th.join()
                gap = first - (t0 + a.deadline)
                gaps.append(gap)
                codes.append(box[0] if box else "?")
                print(f"trial {trial}: long -> {codes[-1]}, small request's first token {gap:.3f} s after the deadline",
                      flush=True)
    finally:
        if busy:
            busy.terminate()
        p.stop()
    print(json.dumps({"busy": a.busy, "median_gap_seconds": statistics.median(gaps), "max_gap_seconds": max(gaps),
                      "long_status": codes}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
