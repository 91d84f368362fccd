"""Per-caller limits: the pure limiter (running and queued places, the 60 s token window, bounded
figures) on a fake clock; the engine loop starting a queued job only while its caller is under its
concurrent limit, and every place coming back whatever ends the request (a result, a cancel, a
deadline, an error); through both APIs on the fake engine: the caller over its queued limit gets
429 / RESOURCE_EXHAUSTED with Retry-After / grpc-retry-pushback-ms while another caller's request
is admitted and completes."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from edgespec.errors import ConfigError
from edgespec.sampling import SamplingParams
from edgespec.server.callers import OTHER, CallerLimited, CallerLimits, Caps, parse_callers
from edgespec.server.config import LimitsConfig, load
from edgespec.server.engine_loop import EngineLoop, Job
from edgespec.types import SpeculationParams
from tests.fake_engine import FakeEngine
from tests.server import test_audit
from tests.server.test_audit import ADMIN_SECRET, USER_SECRET
from tests.server.test_daemon import req
from tests.server.test_http import HTTP, MODEL, raw

named_tokens = test_audit.named_tokens  # the fixture

DASH = "token:ops-dashboard"  # the identity of USER_SECRET in `named_tokens`


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# ---- the pure limiter ---------------------------------------------------------------------------


def test_running_and_queued_places_are_apart():
    lim = CallerLimits(LimitsConfig(caller_concurrent=1, caller_queued=1))
    a1, a2 = lim.place("token:a"), lim.place("token:a")  # a1 will run, a2 waits beyond it
    with pytest.raises(CallerLimited) as e:
        lim.place("token:a")
    assert e.value.reason == "queued" and e.value.retry_after > 0 and "limits.caller_queued" in str(e.value)
    assert lim.counts("token:a") == (0, 2)
    assert a1.start() and not a2.start()  # the caller's one running place
    assert lim.counts("token:a") == (1, 1)
    with pytest.raises(CallerLimited):  # one running, one queued: full
        lim.place("token:a")
    b = lim.place("token:b")  # another caller is not touched
    assert b.start()
    a1.release()
    assert a2.start() and lim.counts("token:a") == (1, 0)
    a2.close()  # the engine holds a started place: the handler's close leaves it
    assert lim.counts("token:a") == (1, 0)
    a2.release()
    a2.release()  # at most once
    b.release()
    assert lim.counts("token:a") == lim.counts("token:b") == (0, 0) and not lim._counts
    other = lim.snapshot()[OTHER]
    assert (other["requests"], other["rejected"], other["running"], other["queued"]) == (3, 2, 0, 0)
    assert other["rejected_by_reason"] == {"concurrent": 0, "queued": 2, "tokens": 0}


def test_requests_within_the_running_room_do_not_count_as_queued():
    """Three arrive before the engine starts any: two will run (concurrent 2), one waits (queued 1)."""
    lim = CallerLimits(LimitsConfig(caller_concurrent=2, caller_queued=1))
    places = [lim.place("anonymous") for _ in range(3)]
    with pytest.raises(CallerLimited):
        lim.place("anonymous")
    assert [p.start() for p in places] == [True, True, False]
    assert lim.counts("anonymous") == (2, 1)


def test_a_released_place_never_starts_and_counts_return_to_zero():
    lim = CallerLimits(LimitsConfig(caller_concurrent=1, caller_queued=3))
    ps = [lim.place("token:a") for _ in range(3)]
    ps[1].close()  # its handler gave up while it was queued
    assert not ps[1].start() and ps[1].state == "released"
    assert ps[0].start()
    for p in ps:
        p.release()
    assert lim.counts("token:a") == (0, 0) and not lim._counts


def test_a_request_that_runs_at_once_is_held_to_the_concurrent_limit():
    lim = CallerLimits(LimitsConfig(caller_concurrent=1))
    with lim.admit("token:a", queued=False):
        with pytest.raises(CallerLimited) as e:
            with lim.admit("token:a", queued=False):
                pass
        assert e.value.reason == "concurrent" and "limits.caller_concurrent" in str(e.value)
        q = lim.place("token:a")  # no queued cap: a generation waits for the place
        assert not q.start()
    assert q.start()
    q.release()
    assert not lim._counts


def test_tokens_per_minute_window_and_retry_after():
    now = [1000.0]
    lim = CallerLimits(LimitsConfig(caller_tokens_per_minute=100), clock=lambda: now[0])
    with lim.admit("anonymous") as place:
        place.used(120)
    now[0] += 20
    with pytest.raises(CallerLimited) as e:
        with lim.admit("anonymous"):
            pass
    assert e.value.retry_after == pytest.approx(40) and e.value.reason == "tokens"
    with lim.admit("token:other"):  # its own window
        pass
    now[0] += 41
    with lim.admit("anonymous"):  # the window moved on
        pass
    figs = lim.snapshot()[OTHER]
    assert figs["tokens"] == 120 and figs["rejected_by_reason"]["tokens"] == 1


def test_per_caller_overrides_both_forms_and_bounded_labels():
    lim = CallerLimits(LimitsConfig(caller_queued=5, callers=("token:batch=2/0", "cert:CN=x=1/3/900")))
    assert lim.caps("token:batch") == Caps(concurrent=2, tokens_per_minute=0, queued=5)  # 2 fields: the default queued
    assert lim.caps("cert:CN=x") == Caps(concurrent=1, tokens_per_minute=900, queued=3)
    assert lim.caps("token:else") == Caps(queued=5)
    assert set(lim.snapshot()) == {"token:batch", "cert:CN=x", OTHER}
    assert parse_callers(["a = 1/2/3"]) == {"a": Caps(1, 3, 2)}


@pytest.mark.parametrize("entry", ["token:a=1", "token:a=1/2/3/4", "=1/2", "token:a=x/2", "token:a=1/-2/3"])
def test_a_bad_override_names_the_key(entry):
    with pytest.raises(ConfigError, match=r"limits\.callers"):
        load(None, env={}, overrides={"limits": {"callers": [entry]}})


def test_caller_queued_is_a_setting_of_its_own():
    assert load(None, env={}, overrides={"limits": {"caller_queued": 3}}).limits.caller_queued == 3
    with pytest.raises(ConfigError, match=r"limits\.caller_queued"):
        load(None, env={}, overrides={"limits": {"caller_queued": -1}})


# ---- the engine loop: queued -> running -> released, exactly -------------------------------------


def job(rid: str, place, max_tokens: int = 400, tokens: tuple[int, ...] = (1, 2, 3)) -> Job:
    return Job(request_id=rid, sampling=SamplingParams(max_tokens=max_tokens),
               speculation=SpeculationParams(mode="plain"), prompt_tokens=tokens, place=place)


def result(j: Job, timeout: float = 10.0):
    while True:
        kind, value = j.events.get(timeout=timeout)
        if kind != "chunk":
            return kind, value


def test_loop_starts_a_job_only_under_its_callers_limit_and_every_place_comes_back():
    lim = CallerLimits(LimitsConfig(caller_concurrent=1, caller_queued=3))
    engine = FakeEngine(parallel=2, n_ctx=8192, step_seconds=0.01)
    loop = EngineLoop(lambda: engine, parallel=2, queue_size=8).start()
    assert loop.wait_loaded(10)
    try:
        a = [loop.submit(job(f"a{i}", lim.place("token:a"))) for i in range(3)]
        b = loop.submit(job("b", lim.place("token:b")))  # after A's queued jobs, in a free slot before them
        wait_for(lambda: {r.request_id for r in engine.requests} == {"a0", "b"})
        assert lim.counts("token:a") == (1, 2) and lim.counts("token:b") == (1, 0)
        assert loop.stats()["active_requests"] == 2 and loop.stats()["queue_depth"] == 2
        bad = loop.submit(job("a-bad", lim.place("token:a"), tokens=()))  # fails as it opens (empty prompt)
        with pytest.raises(CallerLimited):
            lim.place("token:a")
        a[1].cancel()  # queued
        a[2].deadline = time.monotonic()  # queued, past its deadline
        assert result(a[1])[1].finish_reason == "cancelled" and result(a[2])[1].finish_reason == "deadline"
        assert lim.counts("token:a") == (1, 1)
        a[0].cancel()  # running: its place comes back as the engine ends it, and a-bad gets it
        assert result(a[0])[1].finish_reason == "cancelled"
        kind, exc = result(bad)
        assert kind == "error" and "prompt" in str(exc)
        engine.fail_on_step = True  # b ends in an engine error
        assert result(b)[0] == "error"
        wait_for(lambda: not lim._counts)
        engine.fail_on_step = False
        # a place its handler gave up on while queued: the job never runs
        hog = loop.submit(job("hog", lim.place("token:a"), max_tokens=30))
        wait_for(lambda: lim.counts("token:a") == (1, 0))
        gone_place = lim.place("token:a")
        gone = loop.submit(job("gone", gone_place))
        gone_place.close()
        assert result(gone)[1].finish_reason == "cancelled" and "gone" not in {r.request_id for r in engine.requests}
        assert result(hog)[1].finish_reason == "length"
        wait_for(lambda: not lim._counts)
        figs = lim.snapshot()[OTHER]
        assert (figs["running"], figs["queued"], figs["in_flight"]) == (0, 0, 0)
    finally:
        loop.stop()


# ---- through the APIs -------------------------------------------------------------------------------


def test_http_caller_over_its_queued_limit_gets_429_while_another_is_admitted(make_daemon, named_tokens):
    r = make_daemon(http=HTTP, auth=named_tokens, step_seconds=0.03, server={"queue_size": 4},
                    limits={"callers": [f"{DASH}=1/1/0"]})
    lim = r.daemon.callers
    long = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 60}
    dash = {"Authorization": f"Bearer {USER_SECRET}"}
    out: dict[str, tuple] = {}

    def call(name: str, body: dict, headers: dict) -> threading.Thread:
        t = threading.Thread(target=lambda: out.__setitem__(name, raw(r, "POST", "/v1/chat/completions", body, headers)))
        t.start()
        return t

    t1 = call("a1", long, dash)
    wait_for(lambda: lim.counts(DASH) == (1, 0))
    t2 = call("a2", long, dash)  # waits for the caller's one slot, though the server has a second
    wait_for(lambda: lim.counts(DASH) == (1, 1))
    status, headers, body = raw(r, "POST", "/v1/chat/completions", long, dash)
    assert status == 429 and int(headers["retry-after"]) >= 1 and b"ops-dashboard" in body and b"queued" in body
    status, _, body = raw(r, "POST", "/v1/chat/completions", {**long, "max_tokens": 3},
                          {"Authorization": f"Bearer {ADMIN_SECRET}"})
    assert status == 200 and b'"completion_tokens":3' in body.replace(b" ", b"")
    assert "a1" not in out and lim.counts(DASH) == (1, 1)  # B went past A's queued request
    t1.join(20)
    t2.join(20)
    assert out["a1"][0] == out["a2"][0] == 200  # the caller's own requests were not touched
    wait_for(lambda: lim.counts(DASH) == (0, 0))
    assert lim.snapshot()[DASH]["rejected_by_reason"] == {"concurrent": 0, "queued": 1, "tokens": 0}


def test_grpc_caller_over_its_queued_limit_gets_resource_exhausted_and_cancels_leave_nothing(
        make_daemon, named_tokens):
    r = make_daemon(auth=named_tokens, step_seconds=0.03, server={"queue_size": 4},
                    limits={"caller_concurrent": 1, "caller_queued": 1, "callers": [DASH + "=1/0"]})
    lim = r.daemon.callers
    md = (("authorization", f"Bearer {USER_SECRET}"),)
    a1 = r.inference.Generate.future(req(max_tokens=60), timeout=20, metadata=md)
    wait_for(lambda: lim.counts(DASH) == (1, 0))
    a2 = r.inference.Generate.future(req(max_tokens=60), timeout=20, metadata=md)
    wait_for(lambda: lim.counts(DASH) == (1, 1))
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(req(max_tokens=2), timeout=5, metadata=md)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.caller_queued" in e.value.details()
    assert int(dict(e.value.trailing_metadata())["grpc-retry-pushback-ms"]) >= 1
    b = r.inference.Generate(req(max_tokens=3), timeout=5, metadata=(("authorization", f"Bearer {ADMIN_SECRET}"),))
    assert len(b.token_ids) == 3 and not a1.done() and lim.counts(DASH) == (1, 1)
    a2.cancel()  # queued
    a1.cancel()  # running
    wait_for(lambda: lim.counts(DASH) == (0, 0) and not lim._counts)
    assert r.inference.Generate(req(max_tokens=2), timeout=5, metadata=md).text  # its places are back
    assert r.daemon.loop.stats()["active_requests"] == 0


def test_per_caller_figures_in_stats_and_metrics(make_daemon, named_tokens):
    import urllib.request

    from edgespec.proto.edgespec.v1 import admin_pb2

    r = make_daemon(auth=named_tokens, metrics={"enabled": True, "port": 0}, step_seconds=0.03,
                    limits={"callers": [f"{DASH}=1/1/0"]})
    md = (("authorization", f"Bearer {USER_SECRET}"),)
    admin_md = (("authorization", f"Bearer {ADMIN_SECRET}"),)
    r.inference.Generate(req(max_tokens=3), timeout=5, metadata=md)
    a1 = r.inference.Generate.future(req(max_tokens=60), timeout=20, metadata=md)
    wait_for(lambda: r.daemon.callers.counts(DASH) == (1, 0))
    a2 = r.inference.Generate.future(req(max_tokens=60), timeout=20, metadata=md)
    wait_for(lambda: r.daemon.callers.counts(DASH) == (1, 1))
    with pytest.raises(grpc.RpcError):
        r.inference.Generate(req(max_tokens=2), timeout=5, metadata=md)
    st = r.admin.Stats(admin_pb2.StatsRequest(), timeout=5, metadata=admin_md)
    dash = st.callers[DASH]
    assert (dash.requests_total, dash.rejected_total, dash.running, dash.queued, dash.in_flight) == (3, 1, 1, 1, 2)
    assert dict(dash.rejected_by_reason) == {"concurrent": 0, "queued": 1, "tokens": 0} and dash.tokens_total > 3
    assert set(st.callers) == {DASH, "other"}
    port = r.daemon._metrics_server.server_address[1]
    text = urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {ADMIN_SECRET}"}), timeout=5).read().decode()
    assert f'edgespec_caller_requests_total{{caller="{DASH}"}} 3' in text
    assert f'edgespec_caller_running{{caller="{DASH}"}} 1' in text
    assert f'edgespec_caller_queued{{caller="{DASH}"}} 1' in text
    assert f'edgespec_caller_rejected_total{{caller="{DASH}",reason="queued"}} 1' in text
    assert "# TYPE edgespec_caller_tokens_total counter" in text
    a1.cancel()
    a2.cancel()
    wait_for(lambda: r.daemon.callers.counts(DASH) == (0, 0))


# ---- the tokens-per-minute limit under disconnects and concurrency -------------------------------


def test_requests_in_flight_hold_their_tokens_against_the_limit():
    """Admission counts what the caller's requests in flight may still use (prompt + max_tokens):
    concurrent requests overshoot the limit by one request at most, not by all of them."""
    lim = CallerLimits(LimitsConfig(caller_tokens_per_minute=100))
    a = lim.place("anonymous")
    a.reserve(60)
    b = lim.place("anonymous")  # 60 < 100: admitted
    b.reserve(60)
    with pytest.raises(CallerLimited) as e:
        lim.place("anonymous")  # 120 held in flight
    assert e.value.reason == "tokens" and "in flight" in str(e.value)
    a.used(10)  # a ended having used 10 of its 60
    a.release()
    lim.place("anonymous").release()  # 10 used + 60 held by b
    b.release()
    assert not lim._reserved


def _tpm_daemon(make_daemon, cap: int):
    return make_daemon(http=HTTP, step_seconds=0.03, limits={"caller_tokens_per_minute": cap})


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_a_stream_the_client_drops_is_still_charged(make_daemon, api):
    """A client that reads a chunk and goes away (before the final message, which is where the
    handler used to charge) is charged what the engine did for it: its next request is refused."""
    r = _tpm_daemon(make_daemon, cap=2)  # the prompt and the first chunk reach it
    lim = r.daemon.callers
    if api == "grpc":
        stream = r.inference.GenerateStream(req(max_tokens=40), timeout=20)
        next(stream)
        stream.cancel()
    else:
        import http.client
        import json

        conn = http.client.HTTPConnection("127.0.0.1", r.daemon.http_port, timeout=20)
        conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "Hello",
                                                                 "max_tokens": 40, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        conn.close()
    wait_for(lambda: lim.counts("anonymous") == (0, 0) and r.daemon.loop.stats()["active_requests"] == 0)
    assert lim.snapshot()[OTHER]["tokens"] >= 2  # the prompt and what it emitted
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(req(max_tokens=2), timeout=5)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens" in e.value.details()


def test_a_request_in_flight_holds_its_tokens_against_a_concurrent_one(make_daemon):
    r = _tpm_daemon(make_daemon, cap=40)
    stream = r.inference.GenerateStream(req(max_tokens=40), timeout=20)
    next(stream)  # running, nothing charged yet: it holds prompt + 40 tokens
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(req(max_tokens=40), timeout=5)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in e.value.details()
    stream.cancel()


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_a_client_gone_after_the_last_chunk_is_charged_in_full(make_daemon, api):
    """The client reads every token and goes before the final message (gRPC: the one with usage;
    HTTP: the usage chunk and [DONE]): the engine charged the prompt and all 6 tokens at the job's
    end, so with a cap of 7 its next request is refused."""
    r = _tpm_daemon(make_daemon, cap=7)
    lim = r.daemon.callers
    got = 0
    if api == "grpc":
        stream = r.inference.GenerateStream(req(max_tokens=6), timeout=20)
        for chunk in stream:
            got += len(chunk.token_ids)
            if got >= 6 or chunk.finish_reason:
                break
        stream.cancel()
    else:
        import http.client
        import json

        conn = http.client.HTTPConnection("127.0.0.1", r.daemon.http_port, timeout=20)
        conn.request("POST", "/v1/completions", body=json.dumps({
            "model": MODEL, "prompt": "Hello", "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        while line := resp.readline():
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                choice = json.loads(line[6:])["choices"][0]
                got += 1 if choice["text"] else 0
                if choice.get("finish_reason"):
                    break
        conn.close()
    assert got >= 1
    wait_for(lambda: lim.counts("anonymous") == (0, 0) and r.daemon.loop.stats()["active_requests"] == 0)
    assert lim.snapshot()[OTHER]["tokens"] >= 7  # the prompt (1 token at least) and its 6 tokens
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(req(max_tokens=2), timeout=5)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens" in e.value.details()


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_concurrent_requests_overshoot_the_limit_by_one_request_at_most(make_daemon, api):
    """Eight requests of 20 tokens at once against a cap of 30: what the caller is charged in the
    minute stays under the cap plus one request (prompt + max_tokens), whichever are admitted,
    cancelled half-way or refused."""
    import httpx

    r = make_daemon(http=HTTP, step_seconds=0.02, server={"parallel": 4, "queue_size": 8},
                    limits={"caller_tokens_per_minute": 30})
    lim = r.daemon.callers
    codes: list[str] = []

    def one(i: int) -> None:
        if api == "grpc":
            try:
                stream = r.inference.GenerateStream(req(max_tokens=20), timeout=20)
                for n, _ in enumerate(stream):
                    if i % 2 and n == 2:
                        stream.cancel()  # half of them cancel after a few chunks
                        break
                codes.append("ok")
            except grpc.RpcError as e:
                codes.append(e.code().name)
        else:
            with httpx.Client(timeout=20) as c, c.stream(
                    "POST", f"http://127.0.0.1:{r.daemon.http_port}/v1/completions",
                    json={"model": MODEL, "prompt": "Hello", "max_tokens": 20, "stream": True}) as s:
                codes.append(str(s.status_code))
                for n, _ in enumerate(s.iter_lines()):
                    if i % 2 and n == 2:
                        break

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_for(lambda: lim.counts("anonymous") == (0, 0) and r.daemon.loop.stats()["active_requests"] == 0)
    one_request = 20 + 8  # max_tokens and a short prompt's tokens (the fake tokenises a byte a token)
    assert lim.snapshot()[OTHER]["tokens"] <= 30 + one_request, (codes, lim.snapshot())
    assert any(c in ("ok", "200") for c in codes) and any(c in ("RESOURCE_EXHAUSTED", "429") for c in codes), codes
