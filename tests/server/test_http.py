"""The HTTP API over real loopback sockets with the fake engine, driven by the official `openai`
client and raw HTTP: routes, streaming, validation, auth, overload, loading, disconnect, shutdown."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request

import openai
import pytest

from edgespec.server.auth import hash_token
from tests.server.test_daemon import wait_for

MODEL = "SmolLM2-135M-Instruct.F32"
HTTP = {"enabled": True, "port": 0}


def client(r, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{r.daemon.http_port}/v1", api_key=key, max_retries=0, timeout=30)


def raw(r, method: str, path: str, body: object = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", r.daemon.http_port, timeout=30)
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read()
    conn.close()
    return out


def test_chat_unary_and_stream_agree(make_daemon):
    r = make_daemon(http=HTTP)
    c = client(r)
    msgs = [{"role": "user", "content": "Hello"}]
    resp = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=7, temperature=0)
    assert resp.object == "chat.completion" and resp.model == MODEL
    assert resp.choices[0].message.content == "alpha beta gamma delta alpha beta gamma "
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 7 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    extra = resp.model_extra["edgespec"]
    assert extra["target_forwards"] == 5 and extra["tau"] == pytest.approx(7 / 5) and "timings" in extra

    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=7, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == resp.choices[0].message.content
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1  # really streamed
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_steps_slower_than_the_poll_interval(make_daemon, monkeypatch):
    """The waiting thread wakes up between chunks (POLL_SECONDS) without losing any."""
    from edgespec.server import http_jobs

    monkeypatch.setattr(http_jobs, "POLL_SECONDS", 0.001)
    r = make_daemon(http=HTTP, step_seconds=0.02)
    c = client(r)
    assert c.completions.create(model=MODEL, prompt="Hi", max_tokens=4).choices[0].text == "alpha beta gamma delta "
    chunks = c.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks) == "alpha beta gamma delta "


def test_completions_models_tokenize(make_daemon):
    r = make_daemon(http=HTTP)
    c = client(r)
    resp = c.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0.5, seed=1)
    assert resp.choices[0].text == "alpha beta gamma " and resp.object == "text_completion"
    assert [(m.id, m.role) for m in c.models.list()] == [(MODEL, "chat"), (f"{MODEL}-embedding", "embedding"),
                                                          (f"{MODEL}-rerank", "rerank")]
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt="Hi", max_tokens=3,
                                                                           stream=True))
    assert streamed == resp.choices[0].text
    status, _, body = raw(r, "POST", "/tokenize", {"prompt": "ab"})
    assert status == 200 and json.loads(body) == {"tokens": [1, 117, 118], "count": 3,
                                                "max_model_len": r.daemon.cfg.engine.target.n_ctx}
    status, _, body = raw(r, "POST", "/detokenize", {"tokens": [104, 105]})
    assert status == 200 and json.loads(body) == {"prompt": "hi"}
    # the request reached the engine with the caller's fields
    req = r.engine.requests[0]
    assert req.sampling.temperature == 0.5 and req.sampling.seed == 1 and req.sampling.max_tokens == 3


def test_speculation_options_and_stop_reach_the_engine(make_daemon):
    r = make_daemon(http=HTTP)
    client(r).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_completion_tokens=4, top_p=0.9, stop=["zz"],
        extra_body={"top_k": 5, "min_p": 0.1, "edgespec": {"mode": "tree", "tree_nodes": 8, "tree_depth": 3}})
    req = r.engine.requests[0]
    assert (req.sampling.top_k, req.sampling.min_p, req.sampling.top_p, req.sampling.stop) == (5, 0.1, 0.9, ("zz",))
    assert req.sampling.temperature == 1.0  # OpenAI's default when unset
    assert (req.speculation.mode, req.speculation.tree_nodes, req.speculation.tree_depth) == ("tree", 8, 3)


@pytest.mark.parametrize("body, param", [
    ({"n": 9}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stop": [""]}, "stop[0]"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": "f"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"edgespec": {"draft_tokens": 999}}, "edgespec.draft_tokens"),
    ({"edgespec": {"mode": "fast"}}, "edgespec.mode"),
    ({"bogus": 1}, "bogus"),  # under [http] strict = true
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    # [limits], as for gRPC
    ({"messages": [{"role": "user", "content": "x"}] * 1025}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * (1 << 19)}] * 3}, "messages[2].content"),
    ({"stop": ["x" * 257]}, "stop[0]"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),  # a lone surrogate escape
])
def test_bad_params_are_400_naming_them(make_daemon, body, param):
    r = make_daemon(http={**HTTP, "strict": True})
    full = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body}
    status, _, out = raw(r, "POST", "/v1/chat/completions", full)
    err = json.loads(out)["error"]
    assert status == 400 and err["param"] == param and err["type"] == "invalid_request_error", err
    assert not r.engine.requests  # nothing reached the engine


def test_openai_client_sees_400_404_and_engine_side_errors(make_daemon):
    r = make_daemon(http={**HTTP, "strict": True}, n_ctx=64)
    c = client(r)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=30)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as e:  # strict: only the served model
        c.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    for stream in (True, False):
        with pytest.raises(openai.BadRequestError) as e:  # raised on the engine thread (context too small)
            c.completions.create(model=MODEL, prompt="x" * 100, max_tokens=8, stream=stream)
        assert e.value.body["param"] == "prompt"
    for bad in (b"{not json", b"[1, 2]", b"[" * 200_000):
        status, _, out = raw(r, "POST", "/v1/completions", bad)
        assert status == 400 and json.loads(out)["error"]["param"] == "body"


def test_prompt_limits_on_completions_and_tokenize(make_daemon):
    r = make_daemon(http=HTTP, limits={"max_prompt_bytes": 100})
    for path, body in (("/v1/completions", {"prompt": "x" * 101}), ("/tokenize", {"prompt": "x" * 101})):
        status, _, out = raw(r, "POST", path, body)
        err = json.loads(out)["error"]
        assert status == 400 and err["param"] == "prompt" and "limits.max_prompt_bytes" in err["message"]
    assert raw(r, "POST", "/v1/completions", {"prompt": "x" * 100, "max_tokens": 1})[0] == 200


def test_body_larger_than_the_limit_is_413(make_daemon):
    r = make_daemon(http=HTTP, server={"max_message_bytes": 4096})
    status, _, out = raw(r, "POST", "/v1/completions", {"prompt": "x" * 10000})
    assert status == 413 and json.loads(out)["error"]["code"] == "request_too_large"


def test_bearer_tokens_as_for_grpc(make_daemon, tmp_path):
    f = tmp_path / "tokens"
    f.write_text(hash_token("s3cret") + "\n")
    r = make_daemon(http=HTTP, auth={"tokens_file": str(f)})
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.AuthenticationError) as e:
        client(r, "wrong").chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert e.value.status_code == 401
    status, headers, _ = raw(r, "GET", "/v1/models")
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert client(r, "s3cret").chat.completions.create(model=MODEL, messages=msgs, max_tokens=2).choices
    assert raw(r, "GET", "/health")[0] == 200  # health stays open


def test_health_503_while_loading_then_200(make_daemon):
    r = make_daemon(http=HTTP, load_seconds=0.5, wait=False)
    status, headers, body = raw(r, "GET", "/health")
    assert status == 503 and json.loads(body)["status"] == "NOT_SERVING" and "retry-after" in headers
    status, _, body = raw(r, "POST", "/v1/completions", {"prompt": "x"})
    assert status == 503 and json.loads(body)["error"]["code"] == "not_ready"
    assert r.daemon.loop.wait_loaded(10)
    assert wait_for(lambda: raw(r, "GET", "/health")[0] == 200)
    r.daemon._drain(True)
    status, _, body = raw(r, "GET", "/health")
    assert status == 503 and json.loads(body)["status"] == "DRAINING"


def _open_stream(r, max_tokens: int = 4000) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", r.daemon.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": max_tokens, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: {")  # the first token arrived: the job holds the slot
    return resp


def test_deadline_is_504_unary_and_an_error_event_in_a_stream(make_daemon):
    r = make_daemon(http=HTTP, step_seconds=0.01)
    body = {"prompt": "x", "max_tokens": 4000, "edgespec": {"timeout_seconds": 0.2}}
    status, _, out = raw(r, "POST", "/v1/completions", body)
    assert status == 504 and json.loads(out)["error"]["code"] == "deadline_exceeded"
    status, _, out = raw(r, "POST", "/v1/completions", {**body, "stream": True})
    events = [ln[len("data: "):] for ln in out.decode().splitlines() if ln.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "deadline_exceeded"
    assert r.daemon.loop.stats().get("finished_deadline") == 2


def test_overload_is_429_with_retry_after(make_daemon):
    r = make_daemon(http=HTTP, step_seconds=0.01, server={"parallel": 1, "queue_size": 0})
    held = _open_stream(r)
    with pytest.raises(openai.RateLimitError) as e:
        client(r).completions.create(model=MODEL, prompt="y", max_tokens=2)
    assert e.value.response.headers["retry-after"] == "1" and e.value.body["code"] == "overloaded"
    held.close()


def test_a_queued_stream_gets_its_headers_at_once_with_a_keep_alive(make_daemon):
    r = make_daemon(http=HTTP, step_seconds=0.01, server={"parallel": 1, "queue_size": 1})
    held = _open_stream(r)  # the one slot, for 40 s
    conn = http.client.HTTPConnection("127.0.0.1", r.daemon.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "y", "max_tokens": 2, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()  # while the held stream still runs
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    assert resp.readline() == b": ping\n" and r.daemon.loop.stats()["active_requests"] == 1
    held.close()  # the slot frees: the queued request runs
    events = [ln[len("data: "):] for ln in resp.read().decode().splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == \
        "alpha beta "
    conn.close()


def test_a_silent_stream_sends_keep_alives(make_daemon, monkeypatch):
    from edgespec.server import http_stream

    monkeypatch.setattr(http_stream, "KEEPALIVE_SECONDS", 0.02)
    r = make_daemon(http=HTTP, step_seconds=0.1)
    status, _, out = raw(r, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True})
    lines = out.decode().splitlines()
    assert status == 200 and ": ping" in lines
    assert "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines if ln.startswith("data: {")) == \
        "alpha beta gamma "


def test_client_disconnect_cancels_the_job(make_daemon):
    r = make_daemon(http=HTTP, step_seconds=0.01)
    resp = _open_stream(r)
    resp.close()  # the caller goes away mid-stream
    assert wait_for(lambda: r.daemon.loop.stats().get("finished_cancelled", 0) == 1, timeout=10)
    assert wait_for(lambda: r.daemon.loop.stats()["active_requests"] == 0)

    # a unary request whose caller goes away is cancelled too
    conn = http.client.HTTPConnection("127.0.0.1", r.daemon.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 4000}),
                 {"Content-Type": "application/json"})
    assert wait_for(lambda: r.daemon.loop.stats()["active_requests"] == 1)
    conn.close()
    assert wait_for(lambda: r.daemon.loop.stats().get("finished_cancelled", 0) == 2, timeout=10)


def test_shutdown_mid_stream_ends_the_stream_cleanly(make_daemon):
    r = make_daemon(http=HTTP, step_seconds=0.01, server={"grace_seconds": 10.0})
    resp = _open_stream(r, max_tokens=60)
    stopper = threading.Thread(target=r.daemon.shutdown)
    stopper.start()
    rest = resp.read().decode()  # the stream goes on to its end within the grace period
    stopper.join(20)
    events = [line[len("data: "):] for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    finals = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finals[-1] == "length"
    with pytest.raises((ConnectionError, OSError, urllib.error.URLError)):  # no new connections
        raw(r, "GET", "/health")


def test_tls_and_mutual_tls_with_the_grpc_files(make_daemon, certs):
    import ssl

    tls = {"cert": str(certs["server_cert"]), "key": str(certs["server_key"])}
    r = make_daemon(http=HTTP, tls=tls)
    ctx = ssl.create_default_context(cafile=str(certs["ca"]))
    conn = http.client.HTTPSConnection("localhost", r.daemon.http_port, context=ctx, timeout=30)
    conn.request("GET", "/v1/models")
    assert conn.getresponse().status == 200
    conn.close()
    with pytest.raises(ssl.SSLError):  # a client that does not trust the server's CA
        conn = http.client.HTTPSConnection("localhost", r.daemon.http_port, timeout=30,
                                           context=ssl.create_default_context())
        conn.request("GET", "/health")

    m = make_daemon(http=HTTP, tls={**tls, "client_ca": str(certs["ca"])})
    ok = ssl.create_default_context(cafile=str(certs["ca"]))
    ok.load_cert_chain(str(certs["client_cert"]), str(certs["client_key"]))
    conn = http.client.HTTPSConnection("localhost", m.daemon.http_port, context=ok, timeout=30)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert resp.status == 200
    resp.read()
    # the verified certificate is the caller's identity, as over gRPC: no bearer token needed
    conn.request("POST", "/tokenize", body=json.dumps({"prompt": "hello"}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["tokens"]
    conn.request("GET", "/v1/models")
    assert conn.getresponse().status == 200
    conn.close()
    with pytest.raises((ssl.SSLError, ConnectionError)):  # mutual TLS: no client certificate, no answer
        conn = http.client.HTTPSConnection("localhost", m.daemon.http_port, context=ctx, timeout=30)
        conn.request("GET", "/health")
        conn.getresponse()


def test_a_client_certificates_subject_is_written_as_grpc_writes_it():
    from edgespec.server.http_server import cert_subject

    peer = {"subject": ((("countryName", "CN"),), (("organizationName", "Bank"),), (("commonName", "svc-a"),))}
    assert cert_subject(peer) == ("CN=svc-a,O=Bank,C=CN", "svc-a")
    assert cert_subject(None) is None and cert_subject({}) is None


def test_unknown_route_and_wrong_method_say_so(make_daemon):
    r = make_daemon(http=HTTP)
    status, _, out = raw(r, "GET", "/v2/nothing")
    assert status == 404 and json.loads(out)["error"]["code"] == "not_found"
    status, headers, out = raw(r, "GET", "/v1/chat/completions")
    assert status == 405 and json.loads(out)["error"]["code"] == "method_not_allowed" and "POST" in headers["allow"]


def test_unknown_fields_ignored_and_named_unless_strict(make_daemon):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "bogus": 1, "ünï": 2}
    status, _, out = raw(make_daemon(http={**HTTP, "strict": True}), "POST", "/v1/chat/completions", body)
    assert status == 400 and json.loads(out)["error"]["param"] == "bogus"
    lax = make_daemon(http=HTTP)  # the default: front-ends send fields of their own
    status, headers, out = raw(lax, "POST", "/v1/chat/completions", body)
    assert status == 200 and json.loads(out)["choices"][0]["message"]["content"]
    assert headers["x-edgespec-warning"] == "ignored unknown fields: bogus, \\xfcn\\xef"
    status, _, out = raw(lax, "POST", "/v1/chat/completions", {**body, "temperature": -1})
    assert status == 400 and json.loads(out)["error"]["param"] == "temperature"  # known fields still checked
    # another model's name: the served model answers, and says so
    status, headers, out = raw(lax, "POST", "/v1/completions", {"model": "gpt-9", "prompt": "x", "max_tokens": 2})
    assert status == 200 and json.loads(out)["model"] == MODEL
    assert headers["x-edgespec-warning"] == f"model 'gpt-9' is not served here: {MODEL} answered"


def test_sighup_rotates_the_https_certificate(make_daemon, certs, tmp_path):
    import dataclasses
    import ssl

    def served() -> str:
        return ssl.get_server_certificate(("127.0.0.1", r.daemon.http_port))

    def same(pem: str, path) -> bool:
        return ssl.PEM_cert_to_DER_cert(pem) == ssl.PEM_cert_to_DER_cert(path.read_text())

    r = make_daemon(http=HTTP, tls={"cert": str(certs["server_cert"]), "key": str(certs["server_key"])})
    assert same(served(), certs["server_cert"])
    cfg_file = tmp_path / "edgespec.toml"
    cfg_file.write_text(f'[tls]\ncert = "{certs["other_cert"]}"\nkey = "{certs["other_key"]}"\n')
    r.daemon.cfg = dataclasses.replace(r.daemon.cfg, source=str(cfg_file))
    assert r.daemon.reload()
    assert same(served(), certs["other_cert"])  # new handshakes get the rotated pair
    assert "tls" in r.daemon.last_reload["reloaded"]
    cfg_file.write_text(f'[tls]\ncert = "{certs["other_cert"]}"\nkey = "{certs["server_key"]}"\n')  # mismatched
    assert not r.daemon.reload()
    assert same(served(), certs["other_cert"])  # a bad pair changes nothing


def test_metrics_on_the_http_port_take_an_admin_certificate(make_daemon, certs):
    import ssl

    tls = {"cert": str(certs["server_cert"]), "key": str(certs["server_key"]), "client_ca": str(certs["ca"])}
    ok = ssl.create_default_context(cafile=str(certs["ca"]))
    ok.load_cert_chain(str(certs["client_cert"]), str(certs["client_key"]))
    for admin, want in (([], 401), (["CN:edgespec client"], 200)):  # a user's certificate may not scrape
        r = make_daemon(http=HTTP, tls=tls, metrics={"enabled": True, "port": 0}, auth={"admin_subjects": admin})
        conn = http.client.HTTPSConnection("localhost", r.daemon.http_port, context=ok, timeout=30)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        text = resp.read().decode()
        assert resp.status == want and ("# TYPE edgespec_requests_total counter" in text) == (want == 200)
        conn.close()
    assert raw(make_daemon(http=HTTP), "GET", "/metrics")[0] == 404  # [metrics] off: not mounted


def test_n_choices_are_independent_requests_in_one_body(make_daemon):
    r = make_daemon(http=HTTP)
    c = client(r)
    msgs = [{"role": "user", "content": "Hello"}]
    one = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    three = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, n=3)
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    assert all(ch.message.content == one.choices[0].message.content for ch in three.choices)  # greedy
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert len(three.model_extra["edgespec"]["choices"]) == 3
    text = c.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0, n=2)
    assert [ch.index for ch in text.choices] == [0, 1] and text.usage.completion_tokens == 6
    for kwargs in ({"n": 9}, {"n": 0}, {"n": True}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, **kwargs)
        assert e.value.body["param"] == "n"


def _by_choice(chunks, chat: bool) -> dict[int, dict]:
    """A stream's chunks assembled per choice index, as a client does."""
    out: dict[int, dict] = {}
    for ch in chunks:
        for c in ch.choices:
            o = out.setdefault(c.index, {"text": "", "finish": [], "roles": 0, "lp": []})
            if chat:
                o["text"] += c.delta.content or ""
                o["roles"] += c.delta.role == "assistant"
                o["lp"] += [(t.token, t.logprob) for t in (c.logprobs.content if c.logprobs else ())]
            else:
                o["text"] += c.text
                o["lp"] += list(zip(c.logprobs.tokens, c.logprobs.token_logprobs)) if c.logprobs else []
            if c.finish_reason:
                o["finish"].append(c.finish_reason)
    return out


@pytest.mark.parametrize("chat", [True, False])
def test_n_choices_stream_interleaved_as_the_unary_answers(make_daemon, chat):
    r = make_daemon(http=HTTP, server={"parallel": 4})
    r.engine.seeded = True  # each choice's seed (seed + i) gives it its own text and length
    r.engine.eos_after = 6
    c = client(r)
    kw = {"model": MODEL, "max_tokens": 20, "temperature": 0.8, "seed": 5, "n": 3}
    if chat:
        kw |= {"messages": [{"role": "user", "content": "Hello"}], "logprobs": True, "top_logprobs": 1}
        create = c.chat.completions.create
    else:
        kw |= {"prompt": "Hello", "logprobs": 1}
        create = c.completions.create
    unary = create(**kw)
    texts = [ch.message.content if chat else ch.text for ch in unary.choices]
    lps = [[(t.token, t.logprob) for t in ch.logprobs.content] if chat else
           list(zip(ch.logprobs.tokens, ch.logprobs.token_logprobs)) for ch in unary.choices]
    assert len(set(texts)) == 3 and len({len(lp) for lp in lps}) > 1  # the choices differ (their seeds do)
    chunks = list(create(**kw, stream=True, stream_options={"include_usage": True}))
    got = _by_choice(chunks, chat)
    assert sorted(got) == [0, 1, 2]
    assert [got[i]["text"] for i in range(3)] == texts  # each index assembles to its unary answer
    assert [got[i]["lp"] for i in range(3)] == lps  # and its own logprobs
    assert all(got[i]["finish"] == ["stop"] for i in range(3))  # one finish_reason chunk per choice
    if chat:
        assert all(got[i]["roles"] == 1 for i in range(3))
    order = [ch.choices[0].index for ch in chunks if ch.choices]
    assert order != sorted(order)  # interleaved, not one choice after another
    assert chunks[-1].choices == [] and sum(1 for ch in chunks if ch.usage) == 1
    assert chunks[-1].usage.prompt_tokens == unary.usage.prompt_tokens  # the prompt counted once
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens == sum(map(len, lps))
    assert len({ch.id for ch in chunks}) == 1
    assert wait_for(lambda: r.engine.busy == 0)


def test_n_choices_stream_ends_once_and_a_disconnect_cancels_every_choice(make_daemon):
    r = make_daemon(http=HTTP, step_seconds=0.01, server={"parallel": 3})
    status, _, out = raw(r, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 5, "n": 2, "stream": True})
    events = [ln[len("data: "):] for ln in out.decode().splitlines() if ln.startswith("data: ")]
    assert status == 200 and events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    assert sorted(json.loads(e)["choices"][0]["index"] for e in events[:-1]
                  if json.loads(e)["choices"][0]["finish_reason"]) == [0, 1]

    conn = http.client.HTTPConnection("127.0.0.1", r.daemon.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 4000, "n": 3, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: {")
    assert r.engine.busy == 3  # every choice holds a slot
    resp.close()
    conn.close()  # the caller goes away mid-stream
    assert wait_for(lambda: r.daemon.loop.stats().get("finished_cancelled", 0) == 3, timeout=10)
    assert wait_for(lambda: r.engine.busy == 0 and r.daemon.loop.stats()["active_requests"] == 0)
    assert r.engine.free_slots == 3


def test_without_tokens_a_browsers_cross_site_or_rebound_request_is_refused(make_daemon):
    """No token guards a loopback API, so a page in a browser on this host could POST to it (a
    text/plain body needs no preflight) or rebind its own name to 127.0.0.1 and read the answers.
    A request whose Origin is not the API's own, or from this host naming another host, is 403;
    clients that are not browsers (no Origin, a loopback Host) and same-origin pages are served."""
    r = make_daemon(http=HTTP)
    port = r.daemon.http_port
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    plain = {"Content-Type": "text/plain"}

    def post(headers: dict) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        status = conn.getresponse().status
        conn.close()
        return status

    assert post({**plain, "Origin": "https://evil.example"}) == 403
    assert post({**plain, "Origin": "null"}) == 403
    assert post({**plain, "Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}) == 403
    assert post({**plain, "Host": f"evil.example:{port}"}) == 403
    assert r.engine.requests == []
    assert post(plain) == 200  # curl, the openai client: no Origin, Host 127.0.0.1:port
    assert post({**plain, "Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"}) == 200


def test_with_tokens_the_token_decides_whatever_the_origin(make_daemon, tmp_path):
    (tmp_path / "tokens").write_text(hash_token("t") + "\n")
    r = make_daemon(http=HTTP, auth={"tokens_file": str(tmp_path / "tokens")})
    status, _, _ = raw(r, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       headers={"Origin": "https://app.example", "Authorization": "Bearer t"})
    assert status == 200
