"""Constraint and logprobs fields through both APIs (fake engine): request fields become
GenerationRequest.constraint / .logprobs; per-token logprobs come back in responses and chunks."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from edgespec.types import ConstraintSpec
from tests.server.test_daemon import req
from tests.server.test_http import HTTP, MODEL, client, raw


def test_grpc_constraint_and_logprobs_round_trip(make_daemon):
    r = make_daemon()
    g = req(max_tokens=3)
    g.sampling.constraint.kind = "regex"
    g.sampling.constraint.value = "[a-z]+"
    g.logprobs.logprobs = True
    g.logprobs.top_logprobs = 2
    resp = r.inference.Generate(g, timeout=10)
    sent = r.engine.requests[0]
    assert sent.constraint == ConstraintSpec("regex", "[a-z]+") and sent.logprobs == 2
    assert [lp.token_id for lp in resp.logprobs] == list(resp.token_ids)
    assert resp.logprobs[0].logprob == pytest.approx(-0.10) and [t.token_id for t in resp.logprobs[0].top] == [0, 1]
    chunks = list(r.inference.GenerateStream(g, timeout=10))
    assert [lp.token_id for c in chunks for lp in c.logprobs] == [t for c in chunks for t in c.token_ids]
    plain = r.inference.Generate(req(max_tokens=3), timeout=10)
    assert not plain.logprobs and r.engine.requests[-1].constraint is None and r.engine.requests[-1].logprobs is None


@pytest.mark.parametrize("kind, value, top, lp, field", [
    ("xml", "x", 0, False, "sampling.constraint.kind"),
    ("regex", "", 0, False, "sampling.constraint.value"),
    ("json_object", "", 3, False, "logprobs.top_logprobs"),
    ("json_object", "", 21, True, "logprobs.top_logprobs"),
])
def test_grpc_bad_constraint_or_logprobs_names_the_field(make_daemon, kind, value, top, lp, field):
    r = make_daemon()
    g = req()
    g.sampling.constraint.kind, g.sampling.constraint.value = kind, value
    g.logprobs.logprobs, g.logprobs.top_logprobs = lp, top
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(g, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field)


def test_http_response_format_and_logprobs(make_daemon):
    r = make_daemon(http=HTTP)
    c = client(r)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    resp = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                     logprobs=True, top_logprobs=2,
                                     response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    sent = r.engine.requests[0]
    assert sent.constraint == ConstraintSpec("json_schema", json.dumps(schema)) and sent.logprobs == 2
    content = resp.choices[0].logprobs.content
    assert [x.token for x in content] == ["\n", "\x0b", "\x0c"]  # the fake engine's tokens 10, 11, 12
    assert content[0].logprob == pytest.approx(-0.1) and content[0].bytes == [10]
    assert [t.logprob for t in content[0].top_logprobs] == [-5.0, -6.0]
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       logprobs=True, stream=True, response_format={"type": "json_object"})
    got = [x.token for ch in stream if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert got == ["\n", "\x0b", "\x0c"] and r.engine.requests[1].constraint == ConstraintSpec("json_object")
    comp = c.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=1)
    assert comp.choices[0].logprobs.token_logprobs == [pytest.approx(-0.1), pytest.approx(-0.11)]
    assert comp.choices[0].logprobs.text_offset == [0, 1]
    assert c.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].logprobs is None


def test_an_engine_without_the_capability_refuses_by_field(make_daemon, monkeypatch):
    """Until the engine applies constraints, asking for one is a 400 naming the field, not a
    silently unconstrained answer."""
    from tests.fake_engine import FakeEngine

    monkeypatch.setattr(FakeEngine, "capabilities", frozenset())
    r = make_daemon(http=HTTP)
    g = req()
    g.sampling.constraint.kind = "json_object"
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(g, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("sampling.constraint")
    c = client(r)
    msgs = [{"role": "user", "content": "x"}]
    for kwargs, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                          ({"extra_body": {"edgespec": {"constraint": {"kind": "regex", "value": "a"}}}},
                           "edgespec.constraint")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, **kwargs)
        assert e.value.body["param"] == param
    assert not r.engine.requests
    assert c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, logprobs=True).choices[0].logprobs


def test_both_protocols_check_and_tokenise_through_the_one_pipe(make_daemon, monkeypatch):
    """gRPC and every HTTP API check capabilities with pipe.check_capabilities and tokenise with
    pipe.prompt_tokens, naming the fields in their own words: a protocol with checks of its own
    would be missing here, and its prompt would reach the engine untold."""
    from edgespec.server import pipe

    checked: list[tuple[str, str]] = []
    tokenised: list[tuple[int, ...] | None] = []
    check, tokens = pipe.check_capabilities, pipe.prompt_tokens

    def check_spy(loop, limits, **kw):
        checked.append((kw["field"], kw.get("value_field", "")))
        return check(loop, limits, **kw)

    def tokens_spy(*args, **kw):
        tokenised.append(tokens(*args, **kw))
        return tokenised[-1]

    monkeypatch.setattr(pipe, "check_capabilities", check_spy)
    monkeypatch.setattr(pipe, "prompt_tokens", tokens_spy)
    r = make_daemon(http=HTTP)
    g = req(max_tokens=2)
    g.sampling.constraint.kind = "json_object"
    r.inference.Generate(g, timeout=10)
    msgs = [{"role": "user", "content": "x"}]
    client(r).chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                      response_format={"type": "json_object"})
    assert raw(r, "POST", "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": msgs})[0] == 200
    assert raw(r, "POST", "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 2,
                                            "text": {"format": {"type": "json_object"}}})[0] == 200
    assert checked == [("sampling.constraint", "sampling.constraint.value"), ("response_format", ""),
                       ("tools", ""), ("text.format", "")]
    assert tokenised == [tuple(sent.prompt_tokens) for sent in r.engine.requests] and len(tokenised) == 4


def test_constraints_compile_in_the_handlers_thread_never_the_engines(make_daemon):
    """Over both APIs a constraint reaches the engine compiled (GenerationRequest.matcher), by a
    thread that is not the engine's: a large schema or grammar costs its own caller the time.
    One that does not compile is refused before it reaches the engine."""
    r = make_daemon(http=HTTP)
    g = req(max_tokens=3)
    g.sampling.constraint.kind = "regex"
    g.sampling.constraint.value = "[a-z]+"
    r.inference.Generate(g, timeout=10)
    client(r).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2,
                                      extra_body={"edgespec": {"constraint": {"kind": "regex", "value": "[a-z]+"}}})
    sent = r.engine.requests
    assert len(sent) == 3 and len({id(s.matcher) for s in sent}) == 3  # one grammar state per job
    for s in sent:
        kind, spec, thread = s.matcher
        assert spec == s.constraint == ConstraintSpec("regex", "[a-z]+") and thread not in r.engine.threads
    g.sampling.constraint.value = "("
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(g, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unbalanced" in e.value.details()
    assert len(r.engine.requests) == 3


def test_a_constraint_over_its_size_limit_is_refused_naming_the_limit(make_daemon):
    r = make_daemon(http=HTTP, limits={"max_constraint_bytes": 100})
    g = req(max_tokens=3)
    g.sampling.constraint.kind = "regex"
    g.sampling.constraint.value = "a" * 101
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(g, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.constraint.value" in e.value.details() and "limits.max_constraint_bytes" in e.value.details()
    with pytest.raises(openai.BadRequestError) as h:
        client(r).completions.create(model=MODEL, prompt="hi", max_tokens=3,
                                     extra_body={"edgespec": {"constraint": {"kind": "regex", "value": "a" * 101}}})
    assert "limits.max_constraint_bytes" in str(h.value) and "edgespec.constraint" in str(h.value)
    g.sampling.constraint.value = "a" * 100
    assert r.inference.Generate(g, timeout=10).token_ids
    assert not r.engine.requests[:-1]  # the refused ones never reached it
