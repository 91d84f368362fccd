"""Probes against a real daemon. A property-based fuzz of every HTTP route against `edgespec serve` as a real process on the demo
models (loopback, token auth, parallel 2): each example is a route's valid body with fields
replaced or added by random JSON, random JSON or bytes instead of a body, an odd method, content
type or token. No answer may be a 500 (or an internal error inside a stream), every answer comes
within REQUEST_SECONDS, and afterwards /health and a real completion answer at once (no engine
stall) and the log holds no failure. Seeded and bounded: 150 examples, about a minute on 2 cores.
And a hostile-constraint corpus (deep nesting, huge alternations and schemas, catastrophic
regexes): each refused with a 400 naming the field, or compiled and served in bounded time, while
another caller's completions keep their latency.

hypothesis rather than schemathesis: schemathesis generates from an OpenAPI document, which the
daemon does not publish (Starlette routes that validate their own bodies); hypothesis's JSON
strategies mutate the bodies the routes accept, and `derandomize` makes CI runs repeatable.
Slow: CI runs it."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edgespec.config import models_dir
from edgespec.server.auth import hash_token
from edgespec.server.config import DEMO_DRAFT, DEMO_TARGET
from tests.server.processes import start_http_daemon, stop

pytestmark = pytest.mark.slow
MODEL = DEMO_TARGET.removesuffix(".gguf")
USER, ADMIN = "fuzz-user-secret", "fuzz-admin-secret"
REQUEST_SECONDS = 30  # a generate at max_tokens 8 on the demo models takes well under a second
# random requests per run: the default tier's hypothesis profile (tests/conftest.py) draws 50 beside
# one valid request per route; `--hypothesis-profile=nightly` (make test-nightly) draws 150
MESSAGES = [{"role": "user", "content": "Hi"}]
ROUTES: dict[str, tuple[str, dict | None]] = {  # path -> (method, a valid body)
    "/v1/chat/completions": ("POST", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}),
    "/v1/completions": ("POST", {"model": MODEL, "prompt": "Hi", "max_tokens": 4}),
    "/v1/messages": ("POST", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}),
    "/v1/messages/count_tokens": ("POST", {"model": MODEL, "messages": MESSAGES}),
    "/v1/responses": ("POST", {"model": MODEL, "input": "Hi", "max_output_tokens": 4}),
    "/v1/embeddings": ("POST", {"model": MODEL, "input": "Hi"}),
    "/tokenize": ("POST", {"model": MODEL, "prompt": "Hi"}),
    "/detokenize": ("POST", {"model": MODEL, "tokens": [1, 2]}),
    "/v1/models": ("GET", None),
    "/health": ("GET", None),
    "/metrics": ("GET", None),
}
# fields the routes read, beyond their base bodies' (values are drawn at random)
FIELDS = ["stream", "temperature", "top_p", "top_k", "n", "stop", "seed", "logprobs", "top_logprobs",
          "response_format", "tools", "tool_choice", "logit_bias", "stream_options", "presence_penalty",
          "frequency_penalty", "ignore_eos", "max_completion_tokens", "system", "instructions", "text", "reasoning",
          "messages", "prompt", "input", "tokens", "max_tokens", "model", "edgespec", "user", "metadata"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats(allow_nan=True)
    | st.text(max_size=30) | st.sampled_from(["user", "assistant", "system", "tool", "text", "json_schema",
                                              "image_url", "auto", "none", MODEL]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["role", "content", "type", "text", "name", "arguments", "json_schema", "schema", "function",
         "parameters", "include_usage", "id", "tool_call_id", "tool_calls"]) | st.text(max_size=8), inner,
        max_size=4),
    max_leaves=12)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, dict[str, bytes], bytes]:
    path = draw(st.sampled_from(sorted(ROUTES)))
    method, base = ROUTES[path]
    shape = draw(st.sampled_from(["mutated", "mutated", "mutated", "json", "bytes", "method"]))
    if base is None or shape == "method":
        method = draw(st.sampled_from([method, "GET", "POST", "PUT", "DELETE"]))
    if shape == "bytes":
        body = draw(st.binary(max_size=200))
    elif shape == "json" or base is None:
        body = json.dumps(draw(json_values)).encode()
    else:
        doc = dict(base)
        for key in draw(st.lists(st.sampled_from([*base, *FIELDS]), max_size=3)):
            doc[key] = draw(json_values)
        for key in draw(st.lists(st.sampled_from(sorted(base)), max_size=1)):
            doc.pop(key, None)
        if isinstance(doc.get("max_tokens"), int) or "max_tokens" not in doc:
            doc.setdefault("max_tokens", 4)  # a real generate stays short (the daemon caps it at 8)
        body = json.dumps(doc).encode()
    headers = {"content-type": draw(st.sampled_from([b"application/json", b"text/plain", b"application/x-www-form-urlencoded",
                                                     b"application/json; charset=latin-1"]))}
    token = draw(st.sampled_from([USER, USER, USER, ADMIN, "", "wrong", "Bearer", "\u00e9t\u00e9"]))
    if token:
        headers["authorization"] = f"Bearer {token}".encode()
    return method, path, headers, body


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    if not ((models_dir() / DEMO_TARGET).is_file() and (models_dir() / DEMO_DRAFT).is_file()):
        pytest.skip("demo models missing: run `edgespec models prepare-demo`")
    d = tmp_path_factory.mktemp("fuzz")
    (d / "tokens").write_text(f"fuzz:{hash_token(USER)}\n")
    (d / "admin_tokens").write_text(f"ops:{hash_token(ADMIN)}\n")
    proc, _, base = start_http_daemon(d, {
        "EDGESPEC_TARGET_N_CTX": "1024", "EDGESPEC_DRAFT_N_CTX": "1024", "EDGESPEC_SERVER_MAX_TOKENS": "8",
        "EDGESPEC_SERVER_DEFAULT_MAX_TOKENS": "4", "EDGESPEC_SERVER_GRACE_SECONDS": "5",
        "EDGESPEC_SERVER_QUEUE_SIZE": "8", "EDGESPEC_AUTH_TOKENS_FILE": str(d / "tokens"),
        "EDGESPEC_AUTH_ADMIN_TOKENS_FILE": str(d / "admin_tokens"), "EDGESPEC_METRICS_ENABLED": "true",
        "EDGESPEC_METRICS_PORT": "0"}, parallel=2)
    with httpx.Client(base_url=base, timeout=REQUEST_SECONDS) as client:
        # the first requests of a process (the first constraint's compiler over the vocabulary
        # included) are not what the probes time
        client.post("/v1/completions", headers={"authorization": f"Bearer {USER}"}, timeout=300,
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                          "edgespec": {"constraint": {"kind": "regex", "value": "[a-z]+"}}}).raise_for_status()
        yield client, proc, d / "serve.log"
    stop(proc)


def _real_completion(client: httpx.Client) -> float:
    t0 = time.monotonic()
    r = client.post("/v1/completions", headers={"authorization": f"Bearer {USER}"},
                    json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    return time.monotonic() - t0


def _every_route(test):
    """Hypothesis examples: each route's valid request, whatever the random draws reach."""
    for path, (method, base) in ROUTES.items():
        body = b"" if base is None else json.dumps(base).encode()
        headers = {"content-type": b"application/json", "authorization": f"Bearer {USER}".encode()}
        test = example((method, path, headers, body))(test)
    return test


def test_every_route_answers_random_requests_without_a_500_or_a_stall(daemon):
    client, proc, log = daemon
    statuses: dict[tuple[str, int], int] = {}

    @settings(deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @_every_route
    @given(requests())
    def one(rq: tuple[str, str, dict[str, bytes], bytes]) -> None:
        method, path, headers, body = rq
        t0 = time.monotonic()
        r = client.request(method, path, headers=headers, content=body if method != "GET" else None)
        seconds = time.monotonic() - t0
        statuses[(path, r.status_code)] = statuses.get((path, r.status_code), 0) + 1
        assert r.status_code < 500 or r.status_code in (503,), (method, path, body[:300], r.status_code, r.text[:500])
        assert "internal error" not in r.text, (method, path, body[:300], r.text[:500])
        assert seconds < REQUEST_SECONDS, (method, path, body[:300], seconds)

    one()
    assert proc.poll() is None, "the daemon exited"
    assert _real_completion(client) < 5  # the engine is not stalled
    assert client.get("/health").status_code == 200
    text = log.read_text()
    assert "http_failed" not in text and "http_stream_failed" not in text, text[-3000:]
    assert any(s == 200 for (_, s) in statuses) and any(s == 400 for (_, s) in statuses), statuses


def _nested(depth: int) -> str:
    """An object schema nested `depth` deep (built as text: json.dumps would recurse as deep)."""
    return '{"type":"object","required":["a"],"properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


HOSTILE: dict[str, tuple[str, str]] = {  # name -> (constraint kind, value)
    "nested schema x60": ("json_schema", _nested(60)),
    "nested schema x5000": ("json_schema", _nested(5000)),
    "nested arrays x5000": ("json_schema", '{"type":"array","items":' * 5000 + "{}" + "}" * 5000),
    "schema of 3,000 properties": ("json_schema", json.dumps({
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)},
        "required": [f"p{i}" for i in range(3000)]})),
    "enum of 20,000 values": ("json_schema", json.dumps({"enum": [f"value-{i}" for i in range(20000)]})),
    "recursive $ref": ("json_schema", json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"anyOf": [
        {"$ref": "#/$defs/a"}, {"type": "array", "items": {"$ref": "#/$defs/a"}}]}}})),
    "catastrophic pattern": ("json_schema", json.dumps({"type": "string", "pattern": "^(a+)+$"})),
    "regex (a+)+$": ("regex", "(a+)+$"),
    "regex (a|aa)*b": ("regex", "(a|aa)*b"),
    "regex (.*a){25}": ("regex", "(.*a){25}"),
    "regex [ab]*a[ab]{20}": ("regex", "[ab]*a[ab]{20}"),
    "regex a{1000000}": ("regex", "a{1000000}"),
    "regex 30,000 alternatives": ("regex", "(" + "|".join(f"w{i}x" for i in range(30000)) + ")"),
    "regex nested groups x3000": ("regex", "(" * 3000 + "a" + ")" * 3000),
    "lark 3,000 rules": ("lark", "start: r0\n" + "".join(f'r{i}: "t{i}" r{i + 1} | "u{i}"\n' for i in range(3000))
                         + 'r3000: "end"\n'),
    "lark left recursion": ("lark", 'start: e\ne: e "+" e | e "*" e | "(" e ")" | /[0-9]+/\n'),
    # compiles at once and stays under llguidance's fuel, but its masks are costly: 40 juxtaposed,
    # highly ambiguous expressions (Earley sets grow with the text). On the demo vocabulary, under
    # the demo target's greedy text, its masks grow to ~0.1 s a step by 100 tokens; here (8 tokens)
    # it is bounded, and tests/test_constraint.py shows the run-long share pacing it on a long run
    "lark ambiguous x40 (costly masks)": ("lark", "start: " + " ".join(["e"] * 40) + "\n"
                                          'e: e e e e | e e e | e e | e "+" e | /[a-z]/ | "(" e ")"\n'),
    "gbnf deep": ("grammar", "root ::= " + "(" * 2000 + '"a"' + ")" * 2000 + "\n"),
}
# a constraint that compiles costs its own caller at most this (the recursive $ref took 40 s on a
# loaded 2-core box: its caller's time, in its handler's thread)
COMPILE_BOUND_SECONDS = 90


def test_hostile_constraints_are_refused_by_field_or_bounded_while_another_caller_is_served(daemon):
    """Each constraint of the corpus is refused with a 400 naming edgespec.constraint (or the
    size limit), or compiles and its short request ends in bounded time, never a 500; meanwhile
    another caller's plain completions keep their median latency (the compile runs in the
    handler's thread, not the engine's)."""
    import threading

    client, proc, _ = daemon
    baseline = sorted(_real_completion(client) for _ in range(5))[2]
    stop_probe, probe_seconds = threading.Event(), []

    def other_caller() -> None:
        with httpx.Client(base_url=str(client.base_url), timeout=REQUEST_SECONDS) as other:
            while not stop_probe.is_set():
                probe_seconds.append(_real_completion(other))

    probe = threading.Thread(target=other_caller)
    probe.start()
    outcomes: dict[str, str] = {}
    try:
        for name, (kind, value) in HOSTILE.items():
            t0 = time.monotonic()
            r = client.post("/v1/completions", headers={"authorization": f"Bearer {USER}"}, timeout=120,
                            json={"model": MODEL, "prompt": "Answer:", "max_tokens": 8,
                                  "edgespec": {"constraint": {"kind": kind, "value": value}}})
            seconds = time.monotonic() - t0
            outcomes[name] = f"{r.status_code} in {seconds:.2f} s"
            assert r.status_code in (200, 400, 413), (name, r.status_code, r.text[:500])
            if r.status_code == 400:
                err = r.json()["error"]
                assert "constraint" in (err.get("param") or "") + err["message"], (name, err)
            assert seconds < COMPILE_BOUND_SECONDS, (name, outcomes[name])
    finally:
        stop_probe.set()
        probe.join()
    assert proc.poll() is None
    assert len(probe_seconds) >= 3, (probe_seconds, outcomes)
    # the other caller's latency, median and worst, against its own baseline beforehand
    probe_seconds.sort()
    median = probe_seconds[len(probe_seconds) // 2]
    print(f"baseline {baseline:.2f} s; during the corpus median {median:.2f} s, worst {probe_seconds[-1]:.2f} s;",
          outcomes)
    # the goal (0.5 s) holds for the median. A hostile grammar's masks take a bounded share of the
    # engine thread (constraint.MaskLimits: a step's, a tick's, its run's; past one, its own request
    # fails), and its compile runs below the forwards' CPU priority; this corpus's masks take about
    # 1 ms a tick in all. The worst here is the loaded 2-core box's target forwards (seconds each at
    # load 14 or more, the engine thread getting a sixth of a core), so it is only bounded loosely
    assert median < baseline + 0.5 and probe_seconds[-1] < baseline + 30, (baseline, probe_seconds, outcomes)
