"""Several chat models in one daemon ([[chat]]), end to end on the demo's two files (the F32
target and its Q8_0 twin as a second model): routing by `model` over HTTP (the `openai` client)
and gRPC, loading on first use, concurrent answers identical to each model's alone, one caller's
limit across models, and the one memory plan: keep_alive unloading an idle model for another
and loading it again, and a load that outlasts a request's deadline. Slow: CI runs it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.proto.edgespec.v1 import inference_pb2_grpc
from edgespec.server.auth import hash_token
from edgespec.server.config import load
from edgespec.server.daemon import Daemon

pytestmark = pytest.mark.slow
F32, Q8 = "SmolLM2-135M-Instruct.F32", "SmolLM2-135M-Instruct.Q8_0"
KEYS = ("key-a", "key-b")
MESSAGES: Any = [{"role": "user", "content": "Name three colours."}]
NO_END = {"0": -100, "2": -100}  # <|endoftext|>, <|im_end|>: a stream that runs to max_tokens


def _config(directory: Path, demo_pair, extra: str = "", draft: bool = True, keep_alive: float = 0) -> Path:
    (directory / "tokens").write_text("".join(hash_token(k) + "\n" for k in KEYS))
    path = directory / "edgespec.toml"
    path.write_text(f"""
[server]
port = 0
parallel = 1
[http]
enabled = true
port = 0
[auth]
tokens_file = "{directory / 'tokens'}"
[target]
path = "{demo_pair.target}"
n_ctx = 512
[draft]
enabled = {str(draft).lower()}
path = "{demo_pair.draft}"
n_ctx = 512
head = "none"
[embedding]
enabled = false
[rerank]
enabled = false
{extra}
[[chat]]
name = "{Q8}"
load = "on_demand"
keep_alive = {keep_alive}
[chat.target]
path = "{demo_pair.draft}"
n_ctx = 512
[chat.draft]
enabled = false
""")
    return path


class Served:
    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.base = f"http://127.0.0.1:{daemon.http_port}"
        self.channel = grpc.insecure_channel(f"127.0.0.1:{daemon.port}")
        self.inference = inference_pb2_grpc.InferenceStub(self.channel)

    def client(self, key: str = KEYS[0]) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=300)

    def chat(self, model: str, key: str = KEYS[0]) -> str:
        r = self.client(key).chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
        assert r.model == model
        return r.choices[0].message.content or ""

    def loaded(self) -> dict[str, int]:
        return self.daemon.chat_models.loaded_figures()

    def close(self) -> None:
        self.channel.close()
        self.daemon.shutdown(grace=1)


def _serve(path: Path) -> Served:
    daemon = Daemon(load(path, env={}, check_models=True))
    daemon.start()
    assert daemon.loop.wait_loaded(600)
    return Served(daemon)


@pytest.fixture(scope="module")
def two(tmp_path_factory, demo_pair):
    """Both models fit: the second loads on its first request. One request per caller at a time."""
    s = _serve(_config(tmp_path_factory.mktemp("two"), demo_pair, "[limits]\ncaller_concurrent = 1\ncaller_queued = 1",
                       draft=False, keep_alive=600))
    yield s
    s.close()


def test_the_second_model_loads_on_its_first_request_and_both_answer_alike_at_once(two):
    assert two.loaded() == {F32: 1, Q8: 0}
    models = two.client().models.list().data
    assert [(m.id, m.model_extra["role"]) for m in models] == [(F32, "chat"), (Q8, "chat")]
    alone = {F32: two.chat(F32), Q8: two.chat(Q8)}  # the first Q8 request loads it
    assert two.loaded() == {F32: 1, Q8: 1}
    assert alone[F32] and alone[Q8]
    got: dict[str, str] = {}
    threads = [threading.Thread(target=lambda m=m, k=k: got.__setitem__(m, two.chat(m, k)))
               for m, k in ((F32, KEYS[0]), (Q8, KEYS[1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == alone  # greedy: each model's answer while the other decodes is its answer alone
    # gRPC routes by GenerateRequest.model too; an unknown name is NOT_FOUND listing the served ones
    md = (("authorization", f"Bearer {KEYS[0]}"),)
    req = pb.GenerateRequest(model=Q8, messages=[pb.ChatMessage(role="user", content=MESSAGES[0]["content"])],
                             sampling=pb.SamplingOptions(temperature=0, max_tokens=16))
    assert two.inference.Generate(req, metadata=md, timeout=300).text == alone[Q8]
    with pytest.raises(grpc.RpcError) as e:
        two.inference.Generate(pb.GenerateRequest(model="nope", prompt="hi"), metadata=md, timeout=60)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and Q8 in e.value.details()
    # the generation figures carry the model's name; Admin.Stats' totals are every model's
    per = {m: two.daemon.metrics.for_model(m).totals()["requests_total"] for m in (F32, Q8)}
    assert all(per.values()) and two.daemon.all_models.stats()["requests_total"] == sum(per.values())
    text = two.daemon.metrics.render()
    assert f'edgespec_generated_tokens_total{{model="{Q8}"}}' in text
    assert f'edgespec_generated_tokens_total{{model="{F32}"}}' in text
    assert f'edgespec_chat_model_loaded{{model="{Q8}"}} 1.0' in text


def test_model_info_and_the_suffix_cache_are_each_models_own(two, demo_pair):
    """ModelInfo names each model's own files and digests; clearing one model's suffix cache by
    name leaves the other's."""
    from edgespec.models import manifest_entry_for

    md = (("authorization", f"Bearer {KEYS[0]}"),)
    info = {m: two.inference.ModelInfo(pb.ModelInfoRequest(model=m), metadata=md, timeout=60) for m in (F32, Q8)}
    for m, path in ((F32, demo_pair.target), (Q8, demo_pair.draft)):
        assert info[m].target_path == str(path)
        assert (info[m].target_name, info[m].target_sha256) == (manifest_entry_for(str(path)) or ("", ""))
    assert info[Q8].target_sha256 != info[F32].target_sha256 and not info[Q8].draft_path
    two.chat(Q8)
    two.chat(F32)
    models = two.daemon.chat_models.by_name

    def documents() -> dict[str, int]:
        return {m: models[m].call(lambda engine: engine.suffix_stats())["documents"] for m in (F32, Q8)}

    before = documents()
    assert before[F32] and before[Q8]
    two.daemon._clear_suffix(Q8)()
    assert documents() == {F32: before[F32], Q8: 0}


def test_a_callers_limit_holds_across_models(two):
    """caller_concurrent = 1, caller_queued = 1: while key A streams from one model, key A's request
    to the other model waits for A's place, and a third is refused (429); key B's is answered."""
    stream = two.client(KEYS[0]).chat.completions.create(model=F32, messages=MESSAGES, max_tokens=400,
                                                           temperature=0, stream=True, logit_bias=NO_END)
    next(iter(stream))  # the stream holds its caller's place while it runs
    waited: list[str] = []
    queued = threading.Thread(target=lambda: waited.append(two.chat(Q8)))
    queued.start()
    deadline = time.monotonic() + 60
    while not any(f["queued"] for f in two.daemon.callers.snapshot().values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError):
        two.client(KEYS[0]).chat.completions.create(model=Q8, messages=MESSAGES, max_tokens=4, temperature=0)
    assert not waited and two.chat(Q8, KEYS[1])  # another caller goes past
    stream.close()
    queued.join(300)
    assert waited and waited[0]


@pytest.fixture(scope="module")
def tight(tmp_path_factory, demo_pair):
    """A budget one model at a time fits in (keep_alive 0: an idle one may go at once, and the
    on_demand one goes as soon as it is idle)."""
    d = tmp_path_factory.mktemp("tight")
    probe = load(_config(d, demo_pair, draft=False), env={})
    from edgespec.server.chat_plan import models_plan

    entries = probe.chat_entries()
    plan = models_plan(probe.engine, entries[1:], 0, probe.embedding, probe.rerank, default_name=F32)
    budget = max(plan.need(F32), plan.need(Q8)) + plan.side_bytes + 1
    assert budget < plan.all_bytes
    s = _serve(_config(d, demo_pair, f"[models]\nmemory_bytes = {budget}\nkeep_alive = 0", draft=False))
    yield s
    s.close()


def test_keep_alive_unloads_an_idle_model_for_another_and_it_reloads_on_demand(tight):
    assert tight.loaded() == {F32: 1, Q8: 0}
    # a deadline shorter than the load: 504 naming the deadline, never a 500; the load goes on
    r = httpx.post(tight.base + "/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {KEYS[0]}"},
                   json={"model": Q8, "messages": MESSAGES, "max_tokens": 4, "edgespec": {"timeout_seconds": 0.001}})
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
    q8 = tight.chat(Q8)  # waits for the load begun above
    assert q8 and tight.loaded()[F32] == 0  # the idle F32 made room
    assert tight.chat(F32) and tight.loaded() == {F32: 1, Q8: 0}  # and back: reloaded on demand
    assert tight.chat(Q8) == q8  # the reloaded model answers as before
    models = tight.daemon.chat_models
    assert models.by_name[Q8].loads == 2 and models.by_name[F32].unloads == 2
    assert models.loaded_bytes() <= models.budget_bytes
    # Q8 (on_demand, keep_alive 0) unloads once idle with no other model asking for its memory
    deadline = time.monotonic() + 60
    while models.loaded_bytes() > models.side_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tight.loaded() == {F32: 0, Q8: 0} and models.loaded_bytes() == models.side_bytes


def test_a_request_waits_for_memory_within_its_deadline(tight, demo_pair):
    """While one model streams (in use: not unloadable), a request for the other waits for the
    memory; past its own deadline it gets DEADLINE_EXCEEDED, not INTERNAL."""
    tight.chat(F32)
    stream = tight.client().chat.completions.create(model=F32, messages=MESSAGES, max_tokens=400, temperature=0,
                                                    stream=True, logit_bias=NO_END)
    next(iter(stream))
    md = (("authorization", f"Bearer {KEYS[1]}"),)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        tight.inference.Generate(pb.GenerateRequest(model=Q8, prompt="hi"), metadata=md, timeout=1.0)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 10
    stream.close()
    assert tight.loaded()[Q8] == 0


def test_the_plan_counts_every_chat_model(tmp_path, demo_pair):
    from typer.testing import CliRunner

    from edgespec.cli.main import app

    out = CliRunner().invoke(app, ["plan", "--config", str(_config(tmp_path, demo_pair))])
    assert out.exit_code == 0, out.output
    assert f"chat model {F32} (start)" in out.output and f"chat model {Q8} (on_demand)" in out.output
    assert "all chat models at once" in out.output
