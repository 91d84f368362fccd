"""Bit-identical whatever the daemon's history: one daemon (`parallel` 8) serves over 100 greedy
requests mixing auto, chain, tree and plain, lengths, 1 to 8 at a time, cancels mid-stream, and
prompts that share a long prefix (prompt-cache hits and cells shared between slots), and every
output must equal its prompt decoded alone in plain mode by a fresh in-process engine. No tie
allowance: on a CPU every forward is batch-invariant (tools/patches/ggml-batch-invariant.patch).
Slow: CI runs it."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.sampling import SamplingParams
from edgespec.types import GenerationRequest, SpeculationParams
from tests.server.processes import stop
from tests.server.test_e2e import start_server

pytestmark = pytest.mark.slow

SYSTEM = ("You are the compliance assistant of a regional bank. Answer from the policy text below, "
          "briefly, and say when the policy does not cover a question.\n\nPolicy: customer data is "
          "kept for seven years after an account closes; staff may not use personal e-mail for "
          "client matters; gifts above 50 euros must be declared within five working days; "
          "suspicious transactions are reported to the compliance officer the same day.")
QUESTIONS = [
    "How long is customer data kept?", "Can I use my personal e-mail for a client?",
    "A client gave me a 80 euro bottle of wine. What must I do?", "Who receives reports of suspicious transactions?",
    "Is working from home allowed?", "Summarise the policy in one sentence.",
]
FREE = [
    "Write a Python function that reverses a list.", "List three colours.",
    "Draft a short confidentiality clause for a consulting agreement that lasts three years after termination.",
    "用一句话解释什么是投机解码。", "Extract the date as JSON: the contract was signed on 3 May 2024.",
    "Translate to French: the meeting is postponed until Monday.",
]
MODES = [pb.AUTO, pb.CHAIN, pb.TREE, pb.OFF]
MAX_TOKENS = 40


def _messages(i: int) -> list[pb.ChatMessage]:
    if i < len(QUESTIONS):
        return [pb.ChatMessage(role="system", content=SYSTEM), pb.ChatMessage(role="user", content=QUESTIONS[i])]
    return [pb.ChatMessage(role="user", content=FREE[i - len(QUESTIONS)])]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("replay"), "--parallel", "8")
    yield s
    s.channel.close()
    stop(s.proc)


def test_outputs_equal_plain_alone_whatever_the_history(server, engine):
    n_prompts = len(QUESTIONS) + len(FREE)
    prompts = [list(server.inference.Tokenize(pb.TokenizeRequest(messages=_messages(i))).token_ids)
               for i in range(n_prompts)]
    reference = []
    for toks in prompts:  # each prompt alone, plain, in a fresh in-process engine's way
        req = GenerationRequest(tuple(toks), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                SpeculationParams(mode="plain"))
        reference.append(engine.generate(req).token_ids)

    rng = random.Random(24)
    plan = []  # (prompt index, mode, max_tokens, cancel)
    for _ in range(104):
        plan.append((rng.randrange(n_prompts), rng.choice(MODES), rng.choice((8, 24, MAX_TOKENS)),
                     rng.random() < 0.1))
    results: list[tuple[int, int, list[int]]] = []
    cached: list[int] = []
    lock = threading.Lock()

    def one(item) -> None:
        i, mode, max_tokens, cancel = item
        req = pb.GenerateRequest(messages=_messages(i),
                                 sampling=pb.SamplingOptions(temperature=0.0, max_tokens=max_tokens),
                                 speculation=pb.SpeculationOptions(mode=mode))
        if cancel:  # a stream cancelled after its first chunk: it perturbs the daemon's cells
            stream = server.inference.GenerateStream(req, timeout=300)
            try:
                next(stream)
            except (StopIteration, grpc.RpcError):
                pass
            stream.cancel()
            return
        r = server.inference.Generate(req, timeout=300)
        with lock:
            results.append((i, max_tokens, list(r.token_ids)))
            cached.append(r.usage.cached_prompt_tokens)

    at = 0
    with ThreadPoolExecutor(8) as pool:
        while at < len(plan):  # bursts of 1 to 8 requests at a time
            k = rng.randint(1, 8)
            list(pool.map(one, plan[at:at + k]))
            at += k

    assert len(results) >= 80
    bad = [(i, n) for i, n, got in results if got != reference[i][:n]]
    assert not bad, f"{len(bad)} of {len(results)} outputs differ from plain alone: {bad[:5]}"
    assert sum(c > 0 for c in cached) >= 5, "the replay should reuse kept prefills (prompt cache)"


def test_selftest_against_the_live_daemon(server):
    """`edgespec selftest --addr` runs the token-for-token checks through this daemon."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "edgespec.cli.main", "selftest", "--addr", server.addr, "--json",
                          "--max-tokens", "16"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["passed"] and len(report["checks"]) == 6


def test_a_k_quant_target_equals_plain_alone_at_1_4_and_8_streams(tmp_path_factory, model_variant, demo_pair):
    """The demo requantized to Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0 tensors) served with the Q8_0 draft:
    auto, chain and tree requests at 1, 4 and 8 at a time each equal the prompt decoded alone in
    plain mode, no tie allowance."""
    from edgespec.config import EngineConfig, ModelConfig
    from edgespec.engine import Engine

    target = model_variant("q4_k_m")
    s = start_server(tmp_path_factory.mktemp("kquant"), "--parallel", "8",
                     env={"EDGESPEC_TARGET_PATH": str(target), "EDGESPEC_DRAFT_PATH": str(demo_pair.draft)})
    try:
        n_prompts = len(QUESTIONS) + len(FREE)
        prompts = [list(s.inference.Tokenize(pb.TokenizeRequest(messages=_messages(i))).token_ids)
                   for i in range(n_prompts)]
        eng = Engine.load(EngineConfig(target=ModelConfig(path=str(target), n_ctx=1024), draft=None, parallel=1,
                                       suffix_cache=False, prompt_cache_bytes=0), calibrate=False)
        try:
            reference = [eng.generate(GenerationRequest(tuple(t), SamplingParams(temperature=0.0, max_tokens=24),
                                                        SpeculationParams(mode="plain"))).token_ids for t in prompts]
        finally:
            eng.close()

        def one(item):
            i, mode = item
            r = s.inference.Generate(pb.GenerateRequest(
                messages=_messages(i), sampling=pb.SamplingOptions(temperature=0.0, max_tokens=24),
                speculation=pb.SpeculationOptions(mode=mode)), timeout=300)
            return i, list(r.token_ids)

        bad, served = [], 0
        with ThreadPoolExecutor(8) as pool:
            for streams in (1, 4, 8):
                batch = [((streams + k) % n_prompts, MODES[k % 3]) for k in range(8)]
                for at in range(0, len(batch), streams):
                    for i, got in pool.map(one, batch[at:at + streams]):
                        served += 1
                        if got != reference[i]:
                            bad.append((streams, i))
        assert served == 24 and not bad, f"{len(bad)} of {served} outputs differ from plain alone: {bad}"
    finally:
        s.channel.close()
        stop(s.proc)
