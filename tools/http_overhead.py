"""HTTP API overhead against gRPC for the same request, interleaved: `python tools/http_overhead.py
--grpc 127.0.0.1:50051 --http http://127.0.0.1:8080 [--rounds 20] [--max-tokens 32] [--token T]`.
Each round sends the same greedy plain-mode completion over both APIs (order alternating) and
times it end to end in this client; prints the medians and the ratio HTTP / gRPC.
`--fake` starts an in-process daemon on the tests' fake engine (no model, no step time) instead:
what is left is each API's own cost per request, in milliseconds."""

from __future__ import annotations

import argparse
import statistics
import time

import openai

from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.server.channel import ClientOptions, open_channel
from edgespec.proto.edgespec.v1 import inference_pb2_grpc

PROMPT = "Write a Python function that returns the squares of a list of numbers."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grpc", default="127.0.0.1:50051")
    ap.add_argument("--http", default="http://127.0.0.1:8080")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--token", default="none")
    ap.add_argument("--fake", action="store_true", help="measure the APIs alone, on the fake engine")
    a = ap.parse_args()
    daemon = None
    if a.fake:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from edgespec.server.config import load
        from edgespec.server.daemon import Daemon
        from tests.server.fake_engine import FakeEngine

        cfg = load(None, env={}, overrides={"server": {"port": 0, "parallel": 1, "queue_size": 0},
                                            "http": {"enabled": True, "port": 0}})
        daemon = Daemon(cfg, engine_factory=lambda: FakeEngine(parallel=1, n_ctx=8192, step_seconds=0.0))
        daemon.start()
        daemon.loop.wait_loaded(30)
        a.grpc, a.http = f"127.0.0.1:{daemon.port}", f"http://127.0.0.1:{daemon.http_port}"
    opts = ClientOptions(addr=a.grpc, token="" if a.token == "none" else a.token)
    stub = inference_pb2_grpc.InferenceStub(open_channel(opts))
    model = openai.OpenAI(base_url=a.http + "/v1", api_key=a.token, max_retries=0).models.list().data[0].id
    client = openai.OpenAI(base_url=a.http + "/v1", api_key=a.token, max_retries=0, timeout=300)
    req = pb.GenerateRequest(prompt=PROMPT)
    req.sampling.max_tokens = a.max_tokens
    req.sampling.temperature = 0.0
    req.speculation.mode = pb.OFF

    def grpc_call() -> int:
        return len(stub.Generate(req, metadata=opts.metadata, timeout=300).token_ids)

    def http_call() -> int:
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=a.max_tokens, temperature=0,
                                      extra_body={"edgespec": {"mode": "off"}})
        return r.usage.completion_tokens

    times: dict[str, list[float]] = {"grpc": [], "http": []}
    grpc_call(), http_call()  # warm both paths
    for i in range(a.rounds):
        order = (("grpc", grpc_call), ("http", http_call)) if i % 2 == 0 else (("http", http_call), ("grpc", grpc_call))
        for name, fn in order:
            t0 = time.perf_counter()
            n = fn()
            times[name].append(time.perf_counter() - t0)
            assert n == a.max_tokens, (name, n)
    g, h = statistics.median(times["grpc"]), statistics.median(times["http"])
    ratios = [b / a_ for a_, b in zip(times["grpc"], times["http"], strict=True)]
    print(f"rounds {a.rounds}, {a.max_tokens} tokens each: gRPC median {g * 1e3:.1f} ms, HTTP median {h * 1e3:.1f} ms, "
          f"HTTP/gRPC {h / g:.4f} (median of per-round ratios {statistics.median(ratios):.4f}); "
          f"HTTP - gRPC {(h - g) * 1e3:.2f} ms per request")
    if daemon is not None:
        daemon.shutdown(grace=1)


if __name__ == "__main__":
    main()
