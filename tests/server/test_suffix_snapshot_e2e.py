"""A [[chat]] model's suffix-cache snapshot (speculation.suffix_cache_persist) end to end: a daemon
on loopback with two chat models on one file (the demo's Q8_0, so both snapshots carry the same
model identity and only the per-model file keeps them apart), the second on_demand with a short
keep_alive. A request teaches B's cache; B unloads at keep_alive and writes its own snapshot; B
loads again on the next request with what it learnt, and drafts the repeated reply from it; A's
snapshot (written at the stop) holds A's text, not B's. Slow: CI runs it."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from edgespec.drafters.suffix import SuffixCache, snapshot_path
from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.proto.edgespec.v1 import inference_pb2_grpc
from edgespec.server.config import load
from edgespec.server.daemon import Daemon

pytestmark = pytest.mark.slow
A, B = "chat-a", "chat-b"
PROMPTS = {A: "Name three colours.", B: "Count from one to twenty in words."}


def _config(d: Path, model: Path) -> Path:
    path = d / "edgespec.toml"
    path.write_text(f"""
[server]
port = 0
parallel = 1
[target]
path = "{model}"
n_ctx = 512
[draft]
enabled = false
[embedding]
enabled = false
[rerank]
enabled = false
[speculation]
suffix_cache_persist = true
[[chat]]
name = "{B}"
load = "on_demand"
keep_alive = 0.5
[chat.target]
path = "{model}"
n_ctx = 512
[chat.draft]
enabled = false
""")
    return path


def _docs(path: Path) -> list[list[int]]:
    cache = SuffixCache()
    cache.load(path)
    return [toks.tolist() for _, toks in cache._docs.values()]


def test_a_chat_models_suffix_cache_survives_its_unload_in_its_own_snapshot(tmp_path, monkeypatch, demo_pair):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    daemon = Daemon(load(_config(tmp_path, demo_pair.draft), env={}, check_models=True))
    daemon.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{daemon.port}")
    try:
        assert daemon.loop.wait_loaded(600)
        stub = inference_pb2_grpc.InferenceStub(channel)
        models = daemon.chat_models.by_name
        a_name = daemon.chat_models.default.name

        def ask(model: str) -> pb.GenerateResponse:
            return stub.Generate(pb.GenerateRequest(
                model=model, messages=[pb.ChatMessage(role="user", content=PROMPTS.get(model, PROMPTS[A]))],
                sampling=pb.SamplingOptions(temperature=0, max_tokens=40)), timeout=300)

        ask(a_name)
        first = ask(B)  # loads B; its reply goes into B's suffix cache
        assert first.text and models[B].loads == 1
        b_file, a_file = snapshot_path(B), snapshot_path("")
        deadline = time.monotonic() + 60  # keep_alive 0.5 s: B unloads, its snapshot written as its loop stops
        cm = daemon.chat_models
        while not (b_file.is_file() and cm.loaded_bytes() == cm.side_bytes + models[a_name].need_bytes) \
                and time.monotonic() < deadline:  # B's loop stopped: its bytes given back
            time.sleep(0.05)
        assert not models[B].loaded and models[B].unloads == 1
        assert b_file.is_file() and b_file.name.startswith(f"suffix-cache.{B}.") and not a_file.exists()
        b_docs = _docs(b_file)
        assert len(b_docs) == 1 and list(first.token_ids) == b_docs[0][-len(first.token_ids):]  # B's reply, as taught
        again = ask(B)  # loads B again, with its snapshot
        assert models[B].loads == 2 and again.text == first.text
        stats = models[B].call(lambda engine: engine.suffix_stats())
        assert stats["documents"] >= 1 and stats["inserted"] >= 2  # the snapshot's document, then this reply's
        # the repeated reply is drafted from what B learnt before its unload
        assert again.speculation.accepted_tokens > first.speculation.accepted_tokens
        assert again.speculation.accepted_tokens >= 3
    finally:
        channel.close()
        daemon.shutdown(grace=1)
    # A's snapshot (written at the stop) is A's own: its reply, none of B's
    a_docs = _docs(snapshot_path(""))
    assert a_docs and all(d not in a_docs for d in b_docs)
