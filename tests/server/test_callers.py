"""Per-caller limits: the pure limiter (concurrency, the 60 s token window, bounded figures), and
through both APIs on the fake engine: the caller over its own limit gets 429 / RESOURCE_EXHAUSTED
with Retry-After / grpc-retry-pushback-ms while another caller's requests go on."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from edgespec.server.callers import OTHER, CallerLimited, CallerLimits
from edgespec.server.config import LimitsConfig
from tests.server.test_audit import USER_SECRET, named_tokens  # noqa: F401 - the fixture
from tests.server.test_daemon import req
from tests.server.test_http import HTTP, MODEL, raw


def test_concurrency_is_per_caller_and_released():
    lim = CallerLimits(LimitsConfig(caller_concurrent=1, callers=("token:batch=2/0",)))
    with lim.admit("token:a"):
        with pytest.raises(CallerLimited) as e:
            with lim.admit("token:a"):
                pass
        assert e.value.retry_after > 0
        with lim.admit("token:b"):  # another caller is not touched
            pass
        with lim.admit("token:batch"), lim.admit("token:batch"):  # its own cap: 2
            pass
    with lim.admit("token:a"):  # released
        pass
    figs = lim.snapshot()
    assert set(figs) == {"token:batch", OTHER}  # bounded: the named identities and `other`
    assert figs[OTHER]["requests"] == 3 and figs[OTHER]["rejected"] == 1 and figs[OTHER]["in_flight"] == 0


def test_tokens_per_minute_window_and_retry_after():
    now = [1000.0]
    lim = CallerLimits(LimitsConfig(caller_tokens_per_minute=100), clock=lambda: now[0])
    with lim.admit("anonymous") as used:
        used(120)
    now[0] += 20
    with pytest.raises(CallerLimited) as e:
        with lim.admit("anonymous"):
            pass
    assert e.value.retry_after == pytest.approx(40)
    with lim.admit("token:other"):  # its own window
        pass
    now[0] += 41
    with lim.admit("anonymous"):  # the window moved on
        pass
    assert lim.snapshot()[OTHER]["tokens"] == 120


def test_http_caller_over_its_limit_gets_429_others_go_on(make_daemon, named_tokens):  # noqa: F811
    r = make_daemon(http=HTTP, auth=named_tokens, step_seconds=0.05,
                    limits={"callers": ["token:ops-dashboard=1/0"]})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 12}
    user = {"Authorization": f"Bearer {USER_SECRET}"}
    first: list = []
    t = threading.Thread(target=lambda: first.append(raw(r, "POST", "/v1/chat/completions", body, user)))
    t.start()
    deadline = time.monotonic() + 5
    while not r.engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    status, headers, out = raw(r, "POST", "/v1/chat/completions", body, user)
    assert status == 429 and int(headers["retry-after"]) >= 1 and b"ops-dashboard" in out
    t.join(10)
    assert first[0][0] == 200  # the caller's first request was not touched
    assert raw(r, "POST", "/v1/chat/completions", body, user)[0] == 200  # its place is back


def test_grpc_caller_over_its_limit_gets_resource_exhausted_with_pushback(make_daemon, named_tokens):  # noqa: F811
    r = make_daemon(auth=named_tokens, step_seconds=0.05, limits={"caller_concurrent": 1})
    md = (("authorization", f"Bearer {USER_SECRET}"),)
    stream = r.inference.GenerateStream(req(max_tokens=12), timeout=10, metadata=md)
    next(stream)  # running
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(req(max_tokens=2), timeout=5, metadata=md)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(e.value.trailing_metadata())["grpc-retry-pushback-ms"]) >= 1
    list(stream)
    assert r.inference.Generate(req(max_tokens=2), timeout=5, metadata=md).text


def test_per_caller_figures_in_stats_and_metrics(make_daemon, named_tokens):  # noqa: F811
    import urllib.request

    from edgespec.proto.edgespec.v1 import admin_pb2
    from tests.server.test_audit import ADMIN_SECRET

    r = make_daemon(auth=named_tokens, metrics={"enabled": True, "port": 0},
                    limits={"callers": ["token:ops-dashboard=4/0"]})
    md = (("authorization", f"Bearer {USER_SECRET}"),)
    r.inference.Generate(req(max_tokens=3), timeout=5, metadata=md)
    st = r.admin.Stats(admin_pb2.StatsRequest(), timeout=5, metadata=(("authorization", f"Bearer {ADMIN_SECRET}"),))
    dash = st.callers["token:ops-dashboard"]
    assert (dash.requests_total, dash.rejected_total, dash.in_flight) == (1, 0, 0) and dash.tokens_total > 3
    assert set(st.callers) == {"token:ops-dashboard", "other"}
    port = r.daemon._metrics_server.server_address[1]
    text = urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {USER_SECRET}"}), timeout=5).read().decode()
    assert 'edgespec_caller_requests_total{caller="token:ops-dashboard"} 1' in text
    assert "# TYPE edgespec_caller_tokens_total counter" in text
