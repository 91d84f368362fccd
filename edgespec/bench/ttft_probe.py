"""Time to first token on long chat prompts: `edgespec serve` against llama.cpp's llama-server
(the anchor, tools/llama-anchor.sh build), the same target model, threads and context, plain
decoding, alternating fresh processes A B A B. Each process gets a short warm-up request, then one
chat request per prompt size (distinct text every round: no cache can help), `max_tokens` 4,
streamed; the time to first token is taken by the client from sending to the first content
chunk. Prints a table and writes JSON; only the ratio within this one interleaved run is meant to
be read.

usage: python -m edgespec.bench.ttft_probe --anchor-bin DIR [--sizes 560,2800] [--rounds 3]
           [--threads 2] [--json out.json] [--target T.gguf]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from edgespec.bench.serve_systems import (
    daemon_sections,
    start_daemon,
    start_llama_server,
)
from edgespec.bench.suite import SUITES_DIR

SUITE = SUITES_DIR / "long.jsonl"
CHARS_PER_TOKEN = 3.6  # SmolLM2's tokenizer on this English text (the daemon reports the real count)


def context(n_tokens: int, round_no: int) -> str:
    """~n_tokens of prose (the long suite's retrieval and legal documents: ~3.6 characters a token;
    its JSON and code run denser), another start every round."""
    docs = [o["prompt"] for o in map(json.loads, filter(str.strip, SUITE.read_text(encoding="utf-8").splitlines()))
            if o["category"] in ("long-rag", "long-legal")]
    text, i = f"Document set {round_no}.\n", round_no
    while len(text) < n_tokens * CHARS_PER_TOKEN:
        text += docs[i % len(docs)] + "\n"
        i += 1
    return text[: int(n_tokens * CHARS_PER_TOKEN)] + "\nQuestion: which product has the longest warranty? Answer briefly."


def ttft_edgespec(addr: str, text: str, max_tokens: int) -> tuple[float, int]:
    import grpc

    from edgespec.proto.edgespec.v1 import inference_pb2 as pb
    from edgespec.proto.edgespec.v1 import inference_pb2_grpc

    with grpc.insecure_channel(addr) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=text)],
                                 sampling=pb.SamplingOptions(temperature=0.0, max_tokens=max_tokens),
                                 speculation=pb.SpeculationOptions(mode=pb.OFF))
        t0 = time.perf_counter()
        first, prompt_tokens = None, 0
        for chunk in stub.GenerateStream(req, timeout=900):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            if chunk.usage.prompt_tokens:
                prompt_tokens = chunk.usage.prompt_tokens
        return first or float("nan"), prompt_tokens


def ttft_llama(addr: str, text: str, max_tokens: int) -> tuple[float, int]:
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "cache_prompt": False}).encode()
    req = urllib.request.Request(f"http://{addr}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            if first is None and line.startswith(b"data: {") and b'"content":"' in line:
                first = time.perf_counter() - t0
    return first or float("nan"), 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--anchor-bin", required=True, type=Path)
    ap.add_argument("--target", default="")
    ap.add_argument("--sizes", default="560,2800")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    from edgespec.config import models_dir
    from edgespec.server.config import DEMO_TARGET

    target = a.target or str(models_dir() / DEMO_TARGET)
    sizes = [int(x) for x in a.sizes.split(",")]
    n_ctx = 4096
    rows: dict[str, dict[int, list[float]]] = {"edgespec": {n: [] for n in sizes}, "llama-server": {n: [] for n in sizes}}
    counts: dict[int, list[int]] = {n: [] for n in sizes}
    work = Path(tempfile.mkdtemp(prefix="ttft-"))
    for r in range(a.rounds):
        order = ("edgespec", "llama-server") if r % 2 == 0 else ("llama-server", "edgespec")
        for system in order:
            if system == "edgespec":
                p = start_daemon(work, daemon_sections(target=target, draft=None, parallel=1, n_ctx=n_ctx,
                                                       threads=a.threads, max_tokens=a.max_tokens))
                fn = ttft_edgespec
            else:
                p = start_llama_server(a.anchor_bin, work, f"llama-{r}", target=target, draft=None, parallel=1,
                                       n_ctx=n_ctx, threads=a.threads)
                fn = ttft_llama
            try:
                fn(p.addr, "Say hi.", a.max_tokens)  # warm-up
                for n in sizes:
                    t, k = fn(p.addr, context(n, r), a.max_tokens)
                    rows[system][n].append(t)
                    if k:
                        counts[n].append(k)
                    print(f"round {r} {system:<12} ~{n} tokens: ttft {t:.3f} s", flush=True)
            finally:
                p.stop()
    out = {"sizes": sizes, "prompt_tokens": counts, "rounds": a.rounds, "threads": a.threads,
           "ttft_seconds": {s: {str(n): v for n, v in d.items()} for s, d in rows.items()}, "ratio": {}}
    # a round's two systems read the same text: the ratio is taken per round, then its median
    print("\n| prompt tokens (per round) | edgespec median s | llama-server median s | edgespec / llama-server, "
          "median of rounds | per round |")
    print("|---|---:|---:|---:|---|")
    for n in sizes:
        e, ll = statistics.median(rows["edgespec"][n]), statistics.median(rows["llama-server"][n])
        per = [x / y for x, y in zip(rows["edgespec"][n], rows["llama-server"][n])]
        out["ratio"][str(n)] = statistics.median(per)
        out["ratio_per_round"] = {**out.get("ratio_per_round", {}), str(n): per}
        print(f"| {', '.join(map(str, counts[n])) or n} | {e:.3f} | {ll:.3f} | {statistics.median(per):.2f} | "
              f"{' '.join(f'{x:.2f}' for x in per)} |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
