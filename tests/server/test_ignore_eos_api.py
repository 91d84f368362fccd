"""ignore_eos through every API (fake engine): it reaches the request's SamplingParams, a value
that is not a boolean and a constrained request that sets it are refused naming the field."""

from __future__ import annotations

import json

import grpc
import pytest

from edgespec.server.policy import Policy
from tests.server.test_daemon import req
from tests.server.test_http import HTTP, MODEL, raw

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}


def test_grpc_ignore_eos_reaches_the_engine_and_is_refused_with_a_constraint(make_daemon):
    r = make_daemon()
    r.inference.Generate(req(max_tokens=3, ignore_eos=True), timeout=10)
    r.inference.Generate(req(max_tokens=3), timeout=10)
    assert [q.sampling.ignore_eos for q in r.engine.requests] == [True, False]
    g = req(max_tokens=3, ignore_eos=True)
    g.sampling.constraint.kind = "json_object"
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(g, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("sampling.ignore_eos")


def test_http_ignore_eos_reaches_the_engine_on_every_route(make_daemon):
    r = make_daemon(http=HTTP)
    assert raw(r, "POST", "/v1/chat/completions", {**CHAT, "ignore_eos": True})[0] == 200
    assert raw(r, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3, "ignore_eos": True})[0] == 200
    assert raw(r, "POST", "/v1/messages", {**CHAT, "ignore_eos": True})[0] == 200
    assert raw(r, "POST", "/v1/chat/completions", CHAT)[0] == 200
    assert [q.sampling.ignore_eos for q in r.engine.requests] == [True, True, True, False]


@pytest.mark.parametrize("body", [
    {**CHAT, "ignore_eos": "true"},
    {**CHAT, "ignore_eos": 1},
    {**CHAT, "ignore_eos": True, "response_format": {"type": "json_object"}},
    {**CHAT, "ignore_eos": True, "edgespec": {"constraint": {"kind": "regex", "value": "[a-z]+"}}},
    {**CHAT, "ignore_eos": True, "tool_choice": "required",
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
])
def test_http_bad_ignore_eos_is_a_400_naming_it(make_daemon, body):
    r = make_daemon(http=HTTP)
    status, _, data = raw(r, "POST", "/v1/chat/completions", body)
    assert status == 400 and json.loads(data)["error"]["param"] == "ignore_eos"
    assert not r.engine.requests


def test_unset_ignore_eos_is_off_and_any_tools_refuse_it():
    from edgespec.errors import BadRequest
    from edgespec.server import openai_api as oa

    assert not oa.parse_request(CHAT, chat=True, policy=Policy(), models=[MODEL]).sampling.ignore_eos
    # tool_choice none is grammar-constrained too (the answer may not open a call)
    body = {**CHAT, "tool_choice": "none", "ignore_eos": True,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    with pytest.raises(BadRequest) as e:
        oa.parse_request(body, chat=True, policy=Policy(), models=[MODEL])
    assert e.value.field == "ignore_eos"
