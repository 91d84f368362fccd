"""The daemon over real loopback sockets, with the fake engine: API, validation, auth, TLS,
cancel, deadline, overload, drain, policy, health, metrics, error mapping."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgespec.proto.edgespec.v1 import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.server.auth import hash_token
from edgespec.server.channel import ClientOptions, open_channel

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def req(prompt: str = "Hello", max_tokens: int = 8, **sampling) -> pb.GenerateRequest:
    r = pb.GenerateRequest(prompt=prompt)
    r.sampling.max_tokens = max_tokens
    for k, v in sampling.items():
        setattr(r.sampling, k, v)
    return r


def health_status(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def wait_for(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


# ---- API -----------------------------------------------------------------------------------


def test_health_not_serving_until_loaded_then_serving(make_daemon):
    r = make_daemon(load_seconds=0.5, wait=False)
    assert health_status(r.channel) == NOT_SERVING
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(req(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert r.daemon.loop.wait_loaded(10)
    assert wait_for(lambda: health_status(r.channel) == SERVING)
    for svc in ("edgespec.v1.Inference", "edgespec.v1.Admin"):
        assert health_status(r.channel, svc) == SERVING


def test_unary_generate(make_daemon):
    r = make_daemon()
    resp = r.inference.Generate(req(max_tokens=6, temperature=0.7, seed=3), timeout=10)
    assert resp.text == "alpha beta gamma delta alpha beta "
    assert len(resp.token_ids) == 6
    assert resp.finish_reason == pb.LENGTH
    assert resp.usage.prompt_tokens == 6 and resp.usage.completion_tokens == 6
    assert resp.speculation.target_forwards == 4 and resp.speculation.tau == pytest.approx(1.5)
    assert resp.timings.total_seconds > 0 and resp.timings.time_to_first_token_seconds > 0
    assert resp.timings.verify_seconds == pytest.approx(4 * 0.004) and resp.timings.draft_seconds == pytest.approx(4 * 0.001)
    assert resp.request_id


def test_stream_several_chunks_and_final_summary(make_daemon):
    r = make_daemon()
    rq = req(max_tokens=7)
    rq.request_id = "abc-123"
    chunks = list(r.inference.GenerateStream(rq, timeout=10))
    assert len(chunks) >= 3
    assert any(len(c.token_ids) > 1 for c in chunks)  # a step that accepted several tokens
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    final = chunks[-1]
    assert final.finish_reason == pb.LENGTH and final.usage.completion_tokens == 7
    assert "".join(c.text for c in chunks) == "alpha beta gamma delta alpha beta gamma "
    assert sum(len(c.token_ids) for c in chunks) == 7
    assert {c.request_id for c in chunks} == {"abc-123"}


def test_chat_messages_use_template(make_daemon):
    r = make_daemon()
    rq = pb.GenerateRequest(messages=[pb.ChatMessage(role="system", content="Be brief."),
                                      pb.ChatMessage(role="user", content="Hi")])
    rq.sampling.max_tokens = 3
    resp = r.inference.Generate(rq, timeout=10)
    assert resp.finish_reason == pb.LENGTH
    expected = len("<system>Be brief.\n<user>Hi\n<assistant>") + 1
    assert resp.usage.prompt_tokens == expected


def test_tokenize_counts_a_chat_with_the_configured_template(make_daemon, tmp_path):
    """[target] chat_template serves a GGUF without a template: Tokenize must count a chat as
    Generate renders it (bench-serve sizes its prompts with Tokenize), not refuse it."""
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]")
    r = make_daemon(target={"chat_template": str(path)})
    msgs = [pb.ChatMessage(role="user", content="Hi")]
    t = r.inference.Tokenize(pb.TokenizeRequest(messages=msgs), timeout=5)
    g = r.inference.Generate(pb.GenerateRequest(messages=msgs, sampling=pb.SamplingOptions(max_tokens=1)), timeout=10)
    assert t.count == g.usage.prompt_tokens == len("[user]Hi[assistant]") + 1


def test_tokenize_and_model_info(make_daemon):
    r = make_daemon()
    t = r.inference.Tokenize(pb.TokenizeRequest(text="abc", add_special=True), timeout=5)
    assert t.count == 4 and list(t.token_ids)[0] == 1
    info = r.inference.ModelInfo(pb.ModelInfoRequest(), timeout=5)
    assert info.target_path == "/fake/target.gguf" and info.n_ctx == 8192 and info.vocab_size == 256
    assert info.backend == "cpu" and info.details["target.n_params"] == "1"


def test_all_engine_calls_on_one_thread(make_daemon):
    r = make_daemon()
    threads = [threading.Thread(target=lambda: r.inference.Generate(req(max_tokens=4), timeout=10)) for _ in range(4)]
    for t in threads:
        t.start()
    r.inference.Tokenize(pb.TokenizeRequest(text="x"), timeout=5)
    for t in threads:
        t.join()
    assert len(r.engine.threads) == 1


def _wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_idle_work_runs_between_requests_and_yields_to_them(make_daemon):
    """When no request runs, the engine thread does the engine's idle work (the draft absorbing the
    last context) one piece at a time until none is left, then waits; a request or engine call
    arriving meanwhile stops the piece in progress (it waits neither for the rest nor for that
    piece); a failing piece is logged, not fatal."""
    r = make_daemon()
    eng = r.engine
    eng.idle_pieces_per_request, eng.idle_seconds = 5, 0.0
    r.inference.Generate(req(max_tokens=2), timeout=10)
    assert _wait_for(lambda: eng.idle_left == 0)
    calls = eng.idle_calls
    time.sleep(0.3)
    assert eng.idle_calls == calls  # nothing left: the loop waits instead of spinning
    assert len(eng.threads) == 1  # idle work runs on the engine thread too

    eng.idle_pieces_per_request, eng.idle_seconds = 10**6, 0.05  # idle work that never ends
    r.inference.Generate(req(max_tokens=2), timeout=10)
    assert _wait_for(lambda: 0 < eng.idle_left < 10**6)
    # served at all: a loop that waited for the rest of the idle work would never answer (no
    # wall-clock bound to miss on a loaded host)
    assert len(r.inference.Generate(req(max_tokens=2), timeout=60).token_ids) == 2
    eng.idle_left = 0

    # a piece that would take an hour: an arriving request stops it (the engine's abort_idle_work;
    # one that waited would time out), and the flag is lowered again before anything else runs;
    # an engine call (ModelInfo) too
    eng.idle_pieces_per_request, eng.idle_seconds = 3, 3600.0
    for stop in (lambda: r.inference.Generate(req(max_tokens=2), timeout=60),
                 lambda: r.inference.ModelInfo(pb.ModelInfoRequest(), timeout=60)):
        eng.idle_aborts.clear()
        r.inference.Generate(req(max_tokens=2), timeout=10)
        assert _wait_for(lambda: eng.in_piece)
        stop()
        assert _wait_for(lambda: eng.idle_aborts[-1:] == [False])
        assert eng.idle_aborts[:2] == [True, False]
    eng.idle_left = 0
    eng.abort_idle_work(True)  # lets the piece in progress (if any) end
    eng.abort_idle_work(False)

    eng.fail_idle = True
    before = eng.idle_calls
    r.inference.Generate(req(max_tokens=2), timeout=10)
    assert _wait_for(lambda: eng.idle_calls > before)
    eng.fail_idle = False
    assert len(r.inference.Generate(req(max_tokens=2), timeout=10).token_ids) == 2  # still serving


# ---- validation ----------------------------------------------------------------------------

INVALID = [
    ("sampling.temperature", lambda r: setattr(r.sampling, "temperature", -1.0), "[0, 100]"),
    ("sampling.temperature", lambda r: setattr(r.sampling, "temperature", float("nan")), "[0, 100]"),
    ("sampling.top_k", lambda r: setattr(r.sampling, "top_k", -5), ">= 0"),
    ("sampling.top_p", lambda r: setattr(r.sampling, "top_p", 0.0), "(0, 1]"),
    ("sampling.top_p", lambda r: setattr(r.sampling, "top_p", 1.5), "(0, 1]"),
    ("sampling.min_p", lambda r: setattr(r.sampling, "min_p", 1.0), "[0, 1)"),
    ("sampling.seed", lambda r: setattr(r.sampling, "seed", -1), "[0, 2^63)"),
    ("sampling.max_tokens", lambda r: setattr(r.sampling, "max_tokens", 0), "[1, 4096]"),
    ("sampling.max_tokens", lambda r: setattr(r.sampling, "max_tokens", 100000), "[1, 4096]"),
    ("sampling.stop", lambda r: r.sampling.stop.extend(["x"] * 17), "at most 16"),
    ("sampling.stop[1]", lambda r: r.sampling.stop.extend(["x", ""]), "non-empty"),
    ("speculation.mode", lambda r: setattr(r.speculation, "mode", 9), "AUTO, OFF, CHAIN, TREE"),
    ("speculation.draft_tokens", lambda r: setattr(r.speculation, "draft_tokens", 0), "[1, 16]"),
    ("speculation.tree_nodes", lambda r: setattr(r.speculation, "tree_nodes", 65), "[1, 64]"),
    ("speculation.tree_depth", lambda r: setattr(r.speculation, "tree_depth", 17), "[1, 16]"),
    ("messages[0].role", lambda r: (r.ClearField("prompt"), r.messages.add(role="wizard", content="x")), "system, user"),
    ("prompt", lambda r: r.ClearField("prompt"), "one of prompt or messages"),
    ("prompt", lambda r: r.messages.add(role="user", content="x"), "not both"),
    ("request_id", lambda r: setattr(r, "request_id", "bad id!"), "[A-Za-z0-9"),
]


@pytest.mark.parametrize("field,mutate,hint", INVALID, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(INVALID)])
def test_invalid_field_is_invalid_argument_naming_it(make_daemon, field, mutate, hint):
    r = make_daemon()
    rq = req()
    mutate(rq)
    for call in (r.inference.Generate, lambda q, timeout: list(r.inference.GenerateStream(q, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as e:
            call(rq, timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(field + ":"), e.value.details()
        assert hint in e.value.details()


def test_prompt_too_long_names_the_limits(make_daemon):
    r = make_daemon(n_ctx=256)
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(req(prompt="x" * 300, max_tokens=8), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in e.value.details() and "256" in e.value.details()
    assert r.daemon.loop.stats()["active_requests"] == 0


def test_oversized_message_rejected(make_daemon):
    r = make_daemon(server={"max_message_bytes": 4096})
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(req(prompt="x" * 10000), timeout=5)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert r.inference.Generate(req(max_tokens=2), timeout=5).finish_reason == pb.LENGTH  # still serving


# ---- cancel, deadline, overload -------------------------------------------------------------


def test_cancel_mid_stream_frees_the_slot(make_daemon):
    r = make_daemon(step_seconds=0.02, server={"parallel": 1, "queue_size": 0})
    stream = r.inference.GenerateStream(req(max_tokens=2000), timeout=30)
    next(stream)
    assert r.daemon.loop.stats()["active_requests"] == 1
    stream.cancel()
    assert wait_for(lambda: r.daemon.loop.stats()["active_requests"] == 0 and r.engine.busy == 0, 2)
    # the only slot is usable again at once
    assert r.inference.Generate(req(max_tokens=2), timeout=5).finish_reason == pb.LENGTH
    stats = r.admin.Stats(admin_pb2.StatsRequest(), timeout=5)
    assert stats.finished_by_reason["cancelled"] == 1


def test_deadline_stops_generation(make_daemon):
    r = make_daemon(step_seconds=0.02, server={"parallel": 1, "queue_size": 0})
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(req(max_tokens=2000), timeout=0.3)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # the server stops it: the slot is free long before the 40 s the request would decode
    # (waited for, with room for a loaded host, not timed to 2 s)
    assert wait_for(lambda: r.engine.busy == 0, 20)
    assert r.admin.Stats(admin_pb2.StatsRequest(), timeout=5).finished_by_reason["deadline"] == 1


def test_overload_is_resource_exhausted_at_once(make_daemon):
    r = make_daemon(step_seconds=0.02, server={"parallel": 1, "queue_size": 1})
    s1 = r.inference.GenerateStream(req(max_tokens=2000), timeout=30)
    next(s1)
    s2 = r.inference.GenerateStream(req(max_tokens=2000), timeout=30)  # queued
    assert wait_for(lambda: r.daemon.loop.stats()["queue_depth"] == 1)
    with pytest.raises(grpc.RpcError) as e:  # a server that queued it would answer DEADLINE_EXCEEDED
        r.inference.Generate(req(), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    s1.cancel()
    assert next(s2).token_ids  # the queued one gets the slot
    s2.cancel()
    assert wait_for(lambda: r.engine.busy == 0)
    assert r.admin.Stats(admin_pb2.StatsRequest(), timeout=5).rejected_overloaded_total == 1


def test_streams_interleave(make_daemon):
    r = make_daemon(step_seconds=0.01, server={"parallel": 2})
    a = r.inference.GenerateStream(req(max_tokens=200), timeout=30)
    b = r.inference.GenerateStream(req(max_tokens=200), timeout=30)
    next(a), next(b)
    assert r.daemon.loop.stats()["active_requests"] == 2
    next(a), next(b)
    a.cancel(), b.cancel()


def test_engine_error_is_internal_and_daemon_stays_up(make_daemon):
    r = make_daemon()
    r.engine.fail_on_step = True
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(req(), timeout=5)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "request id" in e.value.details() and "boom" not in e.value.details()
    r.engine.fail_on_step = False
    assert r.inference.Generate(req(max_tokens=2), timeout=5).finish_reason == pb.LENGTH


# ---- admin: policy, drain, stats -------------------------------------------------------------


def test_set_policy_off_forces_plain_for_new_requests(make_daemon):
    r = make_daemon()
    rq = req(max_tokens=2)
    rq.speculation.mode = pb.TREE
    r.inference.Generate(rq, timeout=5)
    assert r.engine.requests[-1].speculation.mode == "tree"
    p = r.admin.SetPolicy(admin_pb2.SetPolicyRequest(speculation=admin_pb2.SPECULATION_POLICY_OFF, max_tokens=16), timeout=5)
    assert p.speculation == admin_pb2.SPECULATION_POLICY_OFF and p.max_tokens == 16
    r.inference.Generate(rq, timeout=5)
    assert r.engine.requests[-1].speculation.mode == "plain"
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(req(max_tokens=17), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[1, 16]" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        r.admin.SetPolicy(admin_pb2.SetPolicyRequest(max_tree_depth=99), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("max_tree_depth")


def test_set_policy_clears_the_suffix_cache_through_the_engine(make_daemon):
    """SetPolicy clear_suffix_cache calls the engine's suffix_control (a LoopEngine member: no
    probe for it), on the engine thread."""
    r = make_daemon()
    r.admin.SetPolicy(admin_pb2.SetPolicyRequest(clear_suffix_cache=True), timeout=5)
    assert r.engine.suffix_calls == [(None, True)]
    name = r.daemon.chat_models.default.name  # by name: that chat model's cache
    r.admin.SetPolicy(admin_pb2.SetPolicyRequest(clear_suffix_cache=True, model=name), timeout=5)
    assert r.engine.suffix_calls == [(None, True)] * 2
    before = r.admin.Stats(admin_pb2.StatsRequest(), timeout=5).policy.max_tree_depth
    with pytest.raises(grpc.RpcError) as e:  # a name no chat model has: NOT_FOUND naming the served ones
        r.admin.SetPolicy(admin_pb2.SetPolicyRequest(clear_suffix_cache=True, model="nope", max_tree_depth=2 if before != 2 else 3),
                          timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and name in e.value.details()
    assert r.engine.suffix_calls == [(None, True)] * 2
    # the refused request changed nothing: its policy fields were not applied either
    assert r.admin.Stats(admin_pb2.StatsRequest(), timeout=5).policy.max_tree_depth == before


def test_drain_then_resume(make_daemon):
    r = make_daemon()
    d = r.admin.Drain(admin_pb2.DrainRequest(), timeout=5)
    assert d.draining and health_status(r.channel) == NOT_SERVING
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(req(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not r.admin.Drain(admin_pb2.DrainRequest(resume=True), timeout=5).draining
    assert health_status(r.channel) == SERVING
    r.inference.Generate(req(max_tokens=2), timeout=5)


def test_stats_and_metrics_endpoint(make_daemon):
    r = make_daemon(metrics={"enabled": True, "port": 0})
    r.inference.Generate(req(max_tokens=5), timeout=5)
    s = r.admin.Stats(admin_pb2.StatsRequest(), timeout=5)
    assert s.ready and s.generated_tokens_total == 5 and s.finished_by_reason["length"] == 1
    assert s.policy.speculation == admin_pb2.SPECULATION_POLICY_AUTO
    body = urllib.request.urlopen(f"http://127.0.0.1:{r.daemon.metrics_port}/metrics", timeout=5).read().decode()
    m = 'model="SmolLM2-135M-Instruct.F32"'  # the generation figures carry the chat model's name
    for name in ("edgespec_time_to_first_token_seconds_bucket", f"edgespec_time_per_output_token_seconds_count{{{m}}} 1",
                 f"edgespec_generated_tokens_total{{{m}}} 5", "edgespec_drafted_tokens_total", "edgespec_accepted_tokens_total",
                 f'edgespec_accepted_tokens_by_depth_total{{depth="1",{m}}}', "edgespec_breaker_transitions_total",
                 "edgespec_queue_depth 0", "edgespec_active_requests 0", f'edgespec_requests_total{{finish_reason="length",{m}}} 1',
                 f'edgespec_forward_seconds_total{{{m},part="target"}}', f'edgespec_forward_seconds_total{{{m},part="draft"}}'):
        assert name in body, name


# ---- auth and TLS ----------------------------------------------------------------------------


@pytest.fixture
def token_files(tmp_path):
    user, admin = tmp_path / "tokens", tmp_path / "admin_tokens"
    user.write_text(f"# user tokens\n{hash_token('user-secret')}\n")
    admin.write_text(hash_token("admin-secret") + "\n")
    return {"tokens_file": str(user), "admin_tokens_file": str(admin)}


def test_auth(make_daemon, token_files):
    r = make_daemon(auth=token_files)
    assert health_status(r.channel) == SERVING  # health needs no token
    cases = [((), grpc.StatusCode.UNAUTHENTICATED), ((("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED),
             ((("authorization", "user-secret"),), grpc.StatusCode.UNAUTHENTICATED)]
    for md, code in cases:
        with pytest.raises(grpc.RpcError) as e:
            r.inference.Generate(req(max_tokens=2), timeout=5, metadata=md)
        assert e.value.code() == code
        with pytest.raises(grpc.RpcError) as e:
            list(r.inference.GenerateStream(req(max_tokens=2), timeout=5, metadata=md))
        assert e.value.code() == code
    user = (("authorization", "Bearer user-secret"),)
    admin = (("authorization", "Bearer admin-secret"),)
    assert r.inference.Generate(req(max_tokens=2), timeout=5, metadata=user).text
    with pytest.raises(grpc.RpcError) as e:
        r.admin.Stats(admin_pb2.StatsRequest(), timeout=5, metadata=user)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert r.admin.Stats(admin_pb2.StatsRequest(), timeout=5, metadata=admin).ready
    assert r.inference.Generate(req(max_tokens=2), timeout=5, metadata=admin).text


def test_a_reload_that_reads_an_emptied_token_file_keeps_the_old_tokens(make_daemon, token_files):
    """SIGHUP over a token file truncated to nothing (or to comments) fails, and the tokens in
    force stay: the user's token still works, no token is still refused."""
    from pathlib import Path

    r = make_daemon(auth=token_files)
    user = (("authorization", "Bearer user-secret"),)
    for text in ("", "# revoked\n"):
        Path(token_files["tokens_file"]).write_text(text)
        assert not r.daemon.reload() and not r.daemon.last_reload["ok"]
        assert "no token hash" in r.daemon.last_reload["error"]
        assert r.inference.Generate(req(max_tokens=2), timeout=5, metadata=user).text
        with pytest.raises(grpc.RpcError) as e:
            r.inference.Generate(req(max_tokens=2), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            r.admin.Drain(admin_pb2.DrainRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _tls_daemon(make_daemon, certs, mtls: bool, **sections):
    tls = {"cert": str(certs["server_cert"]), "key": str(certs["server_key"])}
    if mtls:
        tls["client_ca"] = str(certs["ca"])
    return make_daemon(tls=tls, **sections)


def test_tls(make_daemon, certs):
    r = _tls_daemon(make_daemon, certs, mtls=False)
    ok = ClientOptions(addr=f"localhost:{r.daemon.port}", ca=str(certs["ca"]))
    with open_channel(ok) as ch:
        assert inference_pb2_grpc.InferenceStub(ch).Generate(req(max_tokens=2), timeout=5).text
    with grpc.insecure_channel(r.addr) as ch:  # plaintext to a TLS port fails
        with pytest.raises(grpc.RpcError):
            inference_pb2_grpc.InferenceStub(ch).Generate(req(max_tokens=2), timeout=2)


def test_mutual_tls(make_daemon, certs):
    r = _tls_daemon(make_daemon, certs, mtls=True, auth={"admin_subjects": ["CN:edgespec client"]})
    addr = f"localhost:{r.daemon.port}"
    good = ClientOptions(addr=addr, ca=str(certs["ca"]), cert=str(certs["client_cert"]), key=str(certs["client_key"]))
    with open_channel(good) as ch:
        assert inference_pb2_grpc.InferenceStub(ch).Generate(req(max_tokens=2), timeout=5).text
        assert admin_pb2_grpc.AdminStub(ch).Stats(admin_pb2.StatsRequest(), timeout=5).ready
    for bad in (ClientOptions(addr=addr, ca=str(certs["ca"])),  # no client certificate
                ClientOptions(addr=addr, ca=str(certs["ca"]), cert=str(certs["other_cert"]), key=str(certs["other_key"]))):
        with open_channel(bad) as ch:
            with pytest.raises(grpc.RpcError) as e:
                inference_pb2_grpc.InferenceStub(ch).Generate(req(max_tokens=2), timeout=3)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- shutdown and reload --------------------------------------------------------------------


def test_graceful_shutdown_lets_a_stream_finish(make_daemon):
    r = make_daemon(step_seconds=0.01)
    stream = r.inference.GenerateStream(req(max_tokens=40), timeout=30)
    next(stream)
    t = threading.Thread(target=r.daemon.shutdown, kwargs={"grace": 10})
    t.start()
    rest = list(stream)
    assert rest[-1].finish_reason == pb.LENGTH
    t.join(15)
    assert not t.is_alive() and r.engine.closed


def test_sighup_reload_reads_policy(make_daemon, tmp_path):
    r = make_daemon()
    cfg_file = tmp_path / "edgespec.toml"
    cfg_file.write_text('[speculation]\npolicy = "off"\n')
    import dataclasses

    r.daemon.cfg = dataclasses.replace(r.daemon.cfg, source=str(cfg_file))
    r.daemon.reload()
    assert r.daemon.policy().speculation == "off"
    cfg_file.write_text('[speculation]\npolicy = "sideways"\n')
    r.daemon.reload()  # a bad file is logged and ignored
    assert r.daemon.policy().speculation == "off"


def test_the_startup_timeout_grows_with_each_model_and_its_size(tmp_path):
    from edgespec.server.config import load
    from edgespec.server.daemon import STARTUP_DISK_BYTES_PER_SECOND, STARTUP_SECONDS_PER_MODEL, startup_timeout_seconds

    big, small = tmp_path / "big.gguf", tmp_path / "small.gguf"
    with open(big, "wb") as f:
        f.truncate(40 << 30)  # sparse: a 40 GiB target on disk
    small.write_bytes(b"x" * 1000)
    both = load(None, env={}, overrides={"target": {"path": str(big)}, "draft": {"path": str(small)}})
    t = startup_timeout_seconds(both)
    assert t == pytest.approx(2 * STARTUP_SECONDS_PER_MODEL + ((40 << 30) + 1000) / STARTUP_DISK_BYTES_PER_SECOND)
    assert t > 1800  # a 40 GiB model on a slow disk gets more than the old fixed 600 s
    alone = load(None, env={}, overrides={"target": {"path": str(big)}, "draft": {"enabled": False}})
    assert startup_timeout_seconds(alone) == pytest.approx(t - STARTUP_SECONDS_PER_MODEL - 1000 / STARTUP_DISK_BYTES_PER_SECOND)


def test_shutdown_extends_systemds_stop_timeout_past_the_longest_drain(make_daemon, monkeypatch):
    """The unit's TimeoutStopSec (60 s) is shorter than the drain grace_seconds allows (3600 s):
    as the drain starts the daemon asks systemd for as long as shutdown(grace) can take."""
    from edgespec import notify
    from edgespec.server.daemon import stop_timeout_seconds

    sent: list[tuple[str, tuple]] = []
    for name in ("stopping", "extend_timeout"):
        monkeypatch.setattr(notify, name, lambda *a, _n=name: sent.append((_n, a)) or True)
    r = make_daemon(server={"grace_seconds": 3600.0})
    r.daemon.shutdown(grace=0.2)
    assert ("extend_timeout", (stop_timeout_seconds(0.2),)) in sent
    assert stop_timeout_seconds(3600.0) > 2 * 3600 and stop_timeout_seconds(0.2) > 0.2 + 5
