"""The deadline probe: a lone ~2,800-token prompt with a 0.2 s deadline, and a small request sent
right behind it. Reports how long after the deadline the small request got its first token
(the engine must drop the long prompt's forward at once, not finish its n_batch piece), with and
without a CPU-bound busy-loop process beside the daemon (`--busy`). Several trials, one process.

usage: python -m edgespec.bench.deadline_probe [--trials 5] [--busy] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path

from edgespec.bench.serve_systems import daemon_sections, start_daemon


def _spin() -> None:
    while True:
        pass


def trials(addr: str, n: int, deadline: float) -> list[tuple[str, float]]:
    """`n` times: a long prompt with `deadline` seconds, a small request right behind it. Returns
    (the long request's status, seconds from its deadline to the small request's first token)."""
    import grpc

    from edgespec.proto.edgespec.v1 import inference_pb2 as pb
    from edgespec.proto.edgespec.v1 import inference_pb2_grpc

    out = []
    with grpc.insecure_channel(addr) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        small = pb.GenerateRequest(prompt="The capital of France is", sampling=pb.SamplingOptions(max_tokens=2))
        stub.Generate(small, timeout=120)  # warm
        for trial in range(n):
            long = pb.GenerateRequest(prompt=f"Record {trial}. " + "The quick brown fox jumps over the lazy dog. " * 280,
                                      sampling=pb.SamplingOptions(max_tokens=4))
            box: list[str] = []

            def run_long(long: pb.GenerateRequest = long, box: list = box) -> None:
                try:
                    stub.Generate(long, timeout=deadline)
                    box.append("OK")
                except grpc.RpcError as exc:
                    box.append(exc.code().name)

            t0 = time.monotonic()
            th = threading.Thread(target=run_long)
            th.start()
            time.sleep(0.05)  # the long prompt is in the engine first
            first = float("nan")
            for chunk in stub.GenerateStream(small, timeout=120):
                if chunk.token_ids:
                    first = time.monotonic()
                    break
            th.join()
            out.append((box[0] if box else "?", first - (t0 + deadline)))
            print(f"trial {trial}: long -> {out[-1][0]}, small request's first token {out[-1][1]:.3f} s after the deadline",
                  flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from edgespec.config import models_dir
    from edgespec.server.config import DEMO_TARGET

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--busy", action="store_true", help="a busy-loop process beside the daemon")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=0.2)
    a = ap.parse_args(argv)
    sections = daemon_sections(target=str(models_dir() / DEMO_TARGET), draft=None, parallel=1, n_ctx=4096,
                               threads=a.threads, max_tokens=8)
    p = start_daemon(Path(tempfile.mkdtemp(prefix="deadline-")), sections)
    busy = multiprocessing.Process(target=_spin, daemon=True) if a.busy else None
    if busy:
        busy.start()
    try:
        got = trials(p.addr, a.trials, a.deadline)
    finally:
        if busy:
            busy.terminate()
        p.stop()
    gaps = [g for _, g in got]
    print(json.dumps({"busy": a.busy, "median_gap_seconds": statistics.median(gaps), "max_gap_seconds": max(gaps),
                      "long_status": [c for c, _ in got]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
