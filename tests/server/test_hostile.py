"""Hostile callers against the daemon over real loopback sockets (fake engine): each test replays
an attack a probe found and asserts the daemon's answer. Anonymous health floods, oversized and
over-long requests, undecodable protobuf, denormal temperatures, non-ASCII request ids, metrics
without a token, SIGHUP against admin overrides."""

from __future__ import annotations

import dataclasses
import threading
import urllib.error
import urllib.request

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from edgespec.proto.edgespec.v1 import admin_pb2
from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from edgespec.sampling import GREEDY_BELOW, SamplingParams, logits_to_probs
from edgespec.server.auth import hash_token
from tests.server.test_daemon import SERVING, health_status, req, wait_for

USER = (("authorization", "Bearer user-secret"),)
ADMIN = (("authorization", "Bearer admin-secret"),)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def token_files(tmp_path):
    user, admin = tmp_path / "tokens", tmp_path / "admin_tokens"
    user.write_text(hash_token("user-secret") + "\n")
    admin.write_text(hash_token("admin-secret") + "\n")
    return {"tokens_file": str(user), "admin_tokens_file": str(admin)}


@pytest.fixture
def info_logs():
    """structlog events at info level and above, captured (tests otherwise log at warning)."""
    from edgespec import logs

    logs.configure(level="info", json=True)
    try:
        with structlog.testing.capture_logs() as captured:
            yield captured
    finally:
        logs.configure(level="warning", json=True)


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        out = call(*args, **kwargs)
        if hasattr(out, "__iter__") and not hasattr(out, "SerializeToString"):
            list(out)
    return e.value


# ---- 1. anonymous health calls cannot starve authorised work --------------------------------------


def test_anonymous_watch_streams_cannot_starve_authorised_work(make_daemon, token_files):
    """48 Watch streams without metadata (40 made every authorised RPC RESOURCE_EXHAUSTED: they
    held all parallel + queue_size + 32 concurrency slots). Now limits.anonymous_rpcs of them are
    served, the rest refused at once, and authorised Generate, Health/Check and Stats are served
    while they stay open."""
    r = make_daemon(auth=token_files, limits={"anonymous_rpcs": 6})
    attacker = grpc.insecure_channel(r.addr)
    try:
        watches = [health_pb2_grpc.HealthStub(attacker).Watch(health_pb2.HealthCheckRequest(), timeout=60)
                   for _ in range(48)]
        held, refused = [], []
        for w in watches:
            try:
                assert next(w).status == SERVING
                held.append(w)
            except grpc.RpcError as e:
                refused.append(e.code())
        assert len(held) == 6 and refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 42
        for _ in range(3):
            assert r.inference.Generate(req(max_tokens=2), timeout=10, metadata=USER).text
            assert health_pb2_grpc.HealthStub(r.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10, metadata=USER).status == SERVING
            assert r.admin.Stats(admin_pb2.StatsRequest(), timeout=10, metadata=ADMIN).ready
        # anonymous callers share the six slots: full now
        assert rpc_error(health_pb2_grpc.HealthStub(attacker).Check, health_pb2.HealthCheckRequest(),
                         timeout=10).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for w in held[:3]:
            w.cancel()
        assert wait_for(lambda: r.daemon._interceptor.anonymous.in_use == 3)
        assert health_status(attacker) == SERVING  # a slot came back
    finally:
        attacker.close()
    assert wait_for(lambda: r.daemon._interceptor.anonymous.in_use == 0)


def test_refused_calls_do_not_wait_for_their_request(make_daemon, token_files):
    """A call with a wrong token is refused by a handler that never reads the request: a client
    streaming requests into a unary method it may not call gets UNAUTHENTICATED before it sends
    anything (a caller who never sends holds no thread)."""
    r = make_daemon(auth=token_files)
    never = threading.Event()

    def requests():
        never.wait(30)  # never sends a message while the test waits for the answer
        yield from ()

    call = r.channel.stream_unary("/edgespec.v1.Inference/Generate",
                                  request_serializer=lambda m: m, response_deserializer=lambda b: b)
    try:
        e = rpc_error(call, requests(), timeout=10, metadata=(("authorization", "Bearer wrong"),))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        never.set()


# ---- 2. limits checked before the engine sees anything; text work off the engine thread ---------


def test_too_many_messages_refused_before_the_engine(make_daemon):
    r = make_daemon(limits={"max_messages": 64})
    rq = pb.GenerateRequest()
    for _ in range(65):
        rq.messages.add(role="user", content="hi")
    for call in (r.inference.Generate, r.inference.GenerateStream):
        e = rpc_error(call, rq, timeout=10)
        assert e.code() == INVALID and "messages" in e.details() and "limits.max_messages" in e.details()
        assert "64" in e.details()
    t = pb.TokenizeRequest()
    t.messages.extend(rq.messages)
    e = rpc_error(r.inference.Tokenize, t, timeout=10)
    assert e.code() == INVALID and "limits.max_messages" in e.details()
    assert r.engine.requests == [] and r.engine.encoder.calls == 0  # nothing reached the tokenizer


def test_the_default_limit_refuses_100000_messages(make_daemon):
    """The probe's request (100,000 x {user, "hi"}) froze the engine thread for 80 s."""
    r = make_daemon()
    rq = pb.GenerateRequest()
    for _ in range(100_000):
        rq.messages.add(role="user", content="hi")
    e = rpc_error(r.inference.Generate, rq, timeout=10)
    assert e.code() == INVALID and "at most 1024 messages" in e.details()


@pytest.mark.parametrize("field", ["prompt", "messages", "tokenize"])
def test_prompt_bytes_limit(make_daemon, field):
    r = make_daemon(limits={"max_prompt_bytes": 1000})
    big = "é" * 501  # 1002 bytes, 501 characters
    if field == "prompt":
        e = rpc_error(r.inference.Generate, req(big), timeout=10)
        assert e.details().startswith("prompt:")
        assert r.inference.Generate(req("é" * 500), timeout=10).text  # 1000 bytes: allowed
    elif field == "messages":
        rq = pb.GenerateRequest()
        rq.messages.add(role="system", content="x" * 600)
        rq.messages.add(role="user", content="y" * 401)
        e = rpc_error(r.inference.Generate, rq, timeout=10)
        assert e.details().startswith("messages[1].content:")
    else:
        e = rpc_error(r.inference.Tokenize, pb.TokenizeRequest(text=big), timeout=10)
        assert e.details().startswith("text:")
    assert e.code() == INVALID and "limits.max_prompt_bytes" in e.details() and "1000" in e.details()


def with_stops(*stops: str) -> pb.GenerateRequest:
    rq = req()
    rq.sampling.stop.extend(stops)
    return rq


def test_stop_string_limits(make_daemon):
    r = make_daemon(limits={"max_stop_strings": 2, "max_stop_chars": 8})
    e = rpc_error(r.inference.Generate, with_stops("a", "b", "c"), timeout=10)
    assert e.code() == INVALID and "sampling.stop" in e.details() and "limits.max_stop_strings" in e.details()
    e = rpc_error(r.inference.Generate, with_stops("a", "123456789"), timeout=10)
    assert e.code() == INVALID and e.details().startswith("sampling.stop[1]") and "limits.max_stop_chars" in e.details()
    assert r.inference.Generate(with_stops("12345678"), timeout=10).text


def test_prompts_are_tokenised_in_the_handler_threads(make_daemon):
    """Chat templating and tokenising happen in the caller's gRPC thread, on the engine's encoder;
    the engine thread receives token ids (and is the only thread that calls the engine)."""
    r = make_daemon()
    rq = pb.GenerateRequest()
    for i in range(300):
        rq.messages.add(role="user" if i % 2 else "assistant", content=f"m {i}")
    rq.sampling.max_tokens = 2
    resp = r.inference.Generate(rq, timeout=10)
    r.inference.Generate(req("plain prompt", max_tokens=2), timeout=10)
    r.inference.Tokenize(pb.TokenizeRequest(text="abc"), timeout=10)
    eng = r.engine
    assert eng.encoder.calls > 0 and not (eng.encoder.threads & eng.threads)
    assert len(eng.threads) == 1
    expected = r.engine.encoder.tokenize("".join(
        f"<{'user' if i % 2 else 'assistant'}>m {i}\n" for i in range(300)) + "<assistant>")
    assert resp.usage.prompt_tokens == len(expected)
    assert eng.requests[0].prompt_tokens == tuple(expected)


# ---- 7. undecodable protobuf --------------------------------------------------------------------

BAD = b"\xff\xfe"
UNDECODABLE = [
    ("prompt", b"\x0a\x02" + BAD),
    ("messages[0].role", b"\x12\x04\x0a\x02" + BAD),
    ("messages[1].content", b"\x12\x06\x0a\x04user\x12\x0a\x0a\x04user\x12\x02" + BAD),
    ("sampling.stop[1]", b"\x1a\x08\x3a\x02ok\x3a\x02" + BAD),
    ("request_id", b"\x0a\x02hi\x2a\x02" + BAD),
]


@pytest.mark.parametrize("field,data", UNDECODABLE, ids=[f for f, _ in UNDECODABLE])
def test_undecodable_request_is_invalid_argument_naming_the_field(make_daemon, info_logs, field, data):
    r = make_daemon()
    for method, call in (("Generate", r.channel.unary_unary), ("GenerateStream", r.channel.unary_stream)):
        raw = call(f"/edgespec.v1.Inference/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        info_logs.clear()
        e = rpc_error(raw, data, timeout=10)
        assert e.code() == INVALID, (method, e.code(), e.details())
        assert e.details().startswith(f"{field}: is not valid UTF-8"), e.details()
        assert any(ev.get("event") == "rpc_rejected" and ev.get("code") == "INVALID_ARGUMENT"
                   and ev.get("method") == f"/edgespec.v1.Inference/{method}" for ev in info_logs), info_logs
    assert r.engine.requests == []


def test_garbage_bytes_are_invalid_argument_everywhere(make_daemon, token_files):
    r = make_daemon(auth=token_files)
    for method, md in (("/edgespec.v1.Inference/Tokenize", USER), ("/edgespec.v1.Admin/SetPolicy", ADMIN),
                       ("/grpc.health.v1.Health/Check", ()), ("/grpc.health.v1.Health/Check", USER)):
        raw = r.channel.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        e = rpc_error(raw, b"\x0a\x05" + BAD, timeout=10, metadata=md)  # truncated field: not UTF-8 either way
        assert e.code() == INVALID, (method, e.code(), e.details())
    watch = r.channel.unary_stream("/grpc.health.v1.Health/Watch", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
    assert rpc_error(watch, b"\x0a\x02" + BAD, timeout=10).code() == INVALID
    assert wait_for(lambda: r.daemon._interceptor.anonymous.in_use == 0)


# ---- 8. denormal temperatures, 12. request ids ----------------------------------------------------


@pytest.mark.parametrize("t", [5e-324, 1e-310, 1e-300, GREEDY_BELOW / 2])
def test_temperatures_below_the_epsilon_are_greedy(make_daemon, t):
    assert SamplingParams(temperature=t).greedy
    logits = [0.0, 3.0, 1.0]
    assert list(logits_to_probs(logits, SamplingParams(temperature=t))) == [0.0, 1.0, 0.0]
    r = make_daemon()
    r.inference.Generate(req(temperature=t), timeout=10)
    assert r.engine.requests[-1].sampling.temperature == 0.0


def test_a_small_normal_temperature_still_samples(make_daemon):
    s = SamplingParams(temperature=0.05)
    assert not s.greedy
    p = logits_to_probs([0.0, 0.1, 0.05], s)
    assert abs(p.sum() - 1.0) < 1e-12 and all(0.0 < x < 1.0 for x in p)
    r = make_daemon()
    r.inference.Generate(req(temperature=0.05), timeout=10)
    assert r.engine.requests[-1].sampling.temperature == 0.05


@pytest.mark.parametrize("rid", ["请求٣", "٣", "caf\u00e9", "a b", "x" * 129])
def test_request_id_is_ascii_only(make_daemon, rid):
    r = make_daemon()
    rq = req()
    rq.request_id = rid
    e = rpc_error(r.inference.Generate, rq, timeout=10)
    assert e.code() == INVALID and e.details().startswith("request_id:") and "[A-Za-z0-9-_.:]" in e.details()


def test_request_id_allowed_characters(make_daemon):
    r = make_daemon()
    rq = req()
    rq.request_id = "Req-1_a.b:C9"
    assert r.inference.Generate(rq, timeout=10).request_id == "Req-1_a.b:C9"


# ---- 6. metrics ---------------------------------------------------------------------------------


def test_metrics_need_a_token_when_auth_is_on(make_daemon, token_files):
    r = make_daemon(auth=token_files, metrics={"enabled": True, "port": 0})
    url = f"http://127.0.0.1:{r.daemon.metrics_port}/metrics"
    for header in (None, "Bearer wrong", "user-secret", "Bearer user-secret"):  # a user token may not scrape
        rq = urllib.request.Request(url, headers={"Authorization": header} if header else {})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(rq, timeout=5)
        assert e.value.code == 401
    for token in ("admin-secret",):
        rq = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        assert "edgespec_ready 1" in urllib.request.urlopen(rq, timeout=5).read().decode()


# ---- 10. SIGHUP keeps admin overrides -----------------------------------------------------------


def test_sighup_keeps_admin_overrides_until_reset(make_daemon, tmp_path, info_logs):
    r = make_daemon()
    cfg_file = tmp_path / "edgespec.toml"
    cfg_file.write_text("[speculation]\nmax_draft_tokens = 8\n")
    r.daemon.cfg = dataclasses.replace(r.daemon.cfg, source=str(cfg_file))
    p = r.admin.SetPolicy(admin_pb2.SetPolicyRequest(speculation=admin_pb2.SPECULATION_POLICY_OFF, max_tokens=100),
                          timeout=5)
    assert (p.speculation, p.max_tokens) == (admin_pb2.SPECULATION_POLICY_OFF, 100)
    info_logs.clear()
    r.daemon.reload()  # what SIGHUP does
    policy = r.admin.Stats(admin_pb2.StatsRequest(), timeout=5).policy
    assert (policy.speculation, policy.max_tokens) == (admin_pb2.SPECULATION_POLICY_OFF, 100)  # kept
    assert policy.max_draft_tokens == 8  # the file's new value applies beneath them
    reloaded = next(ev for ev in info_logs if ev["event"] == "config_reloaded")
    assert reloaded["admin_overrides_kept"] == {"speculation": "off", "max_tokens": 100}
    e = rpc_error(r.inference.Generate, req(max_tokens=101), timeout=5)
    assert e.code() == INVALID and "[1, 100]" in e.details()
    r.inference.Generate(req(max_tokens=4), timeout=5)
    assert r.engine.requests[-1].speculation.mode == "plain"
    # reset: the file's values again (policy auto, max_tokens 4096), then this request's field
    p = r.admin.SetPolicy(admin_pb2.SetPolicyRequest(reset=True, max_tree_depth=3), timeout=5)
    assert (p.speculation, p.max_tokens, p.max_draft_tokens, p.max_tree_depth) == (
        admin_pb2.SPECULATION_POLICY_AUTO, 4096, 8, 3)
    r.daemon.reload()
    assert r.admin.Stats(admin_pb2.StatsRequest(), timeout=5).policy.max_tree_depth == 3


def test_a_rejected_value_is_cut_short_in_the_logs_and_the_answer(make_daemon, info_logs):
    """A 200,000-character bad value (a temperature over HTTP, a constraint kind over gRPC) is quoted in
    the refusal, cut to MAX_MESSAGE_CHARS: the access log line and the answer stay short."""
    import json as json_

    from edgespec.errors import MAX_MESSAGE_CHARS

    huge = "x" * 200_000
    r = make_daemon(http={"enabled": True, "port": 0})
    conn = __import__("http.client").client.HTTPConnection("127.0.0.1", r.daemon.http_port, timeout=30)
    conn.request("POST", "/v1/completions", body=json_.dumps({"prompt": "hi", "temperature": huge}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    assert resp.status in (400, 404) and len(body) < MAX_MESSAGE_CHARS + 500
    g = req(max_tokens=2)
    g.sampling.stop.append("ok")
    g.request_id = "r1"
    g.sampling.constraint.kind = huge
    e = rpc_error(r.inference.Generate, g, timeout=10)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.details()) < MAX_MESSAGE_CHARS + 200
    rejected = [ev for ev in info_logs if ev.get("event") in ("http_rejected", "rpc_rejected")]
    assert len(rejected) == 2 and all(len(repr(ev)) < MAX_MESSAGE_CHARS + 600 for ev in rejected), \
        [len(repr(ev)) for ev in rejected]
