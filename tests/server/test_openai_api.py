"""openai_api.py (pure): request validation and response bodies; and the [http] config rules."""

from __future__ import annotations

import pytest

from edgespec.errors import BadRequest
from edgespec.server import openai_api as oa
from edgespec.server.config import InvalidConfig, load
from edgespec.server.policy import Policy
from edgespec.types import ConstraintSpec, GenerationResult, SpecStats, TokenLogprob

M = ("m",)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def parse(body: dict, chat: bool = True, policy: Policy | None = None) -> oa.CompletionRequest:
    return oa.parse_request(body, chat=chat, policy=policy or Policy(), models=M)


def test_defaults_follow_openai_and_the_policy():
    r = parse(CHAT)
    assert r.sampling.temperature == 1.0 and r.sampling.top_p == 1.0 and r.sampling.max_tokens == 256
    assert r.speculation.mode == "auto" and r.logprobs is None and r.constraint is None and not r.stream
    assert parse(CHAT, policy=Policy(speculation="off")).speculation.mode == "plain"
    assert parse(CHAT, policy=Policy(default_mode="chain")).speculation.mode == "chain"


def test_fields_map_to_domain_values():
    r = parse({**CHAT, "max_tokens": 9, "max_completion_tokens": 5, "stop": "END", "top_k": -1, "seed": 7,
               "logprobs": True, "top_logprobs": 4, "stream": True, "stream_options": {"include_usage": True},
               "response_format": {"type": "json_object"},
               "edgespec": {"mode": "off", "draft_tokens": 2, "timeout_seconds": 1.5}})
    assert r.sampling.max_tokens == 5 and r.sampling.stop == ("END",) and r.sampling.top_k == 0
    assert r.sampling.seed == 7 and r.logprobs == 4 and r.stream and r.include_usage
    assert r.constraint == ConstraintSpec("json_object") and r.speculation.mode == "plain"
    assert r.speculation.draft_tokens == 2 and r.timeout_seconds == 1.5
    r = parse({**CHAT, "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}]})
    assert r.messages == (("system", "ab"),)
    r = parse({"model": "m", "prompt": ["one"], "logprobs": 2}, chat=False)
    assert r.prompt == "one" and r.logprobs == 2 and not r.messages
    r = parse({**CHAT, "edgespec": {"constraint": {"kind": "regex", "value": "[0-9]+"}}})
    assert r.constraint == ConstraintSpec("regex", "[0-9]+")


@pytest.mark.parametrize("body, chat, field", [
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, True,
     "messages[0].content[0].type"),
    ({**CHAT, "messages": []}, True, "messages"),
    ({**CHAT, "stream_options": {"include_usage": True}}, True, "stream_options"),
    ({**CHAT, "temperature": True}, True, "temperature"),
    ({**CHAT, "temperature": float("nan")}, True, "temperature"),
    ({**CHAT, "max_tokens": 5000}, True, "max_tokens"),
    ({**CHAT, "seed": -1}, True, "seed"),
    ({**CHAT, "stop": ["a"] * 17}, True, "stop"),
    ({**CHAT, "prompt": "x"}, True, "prompt"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, True,
     "response_format.json_schema.schema"),
    ({**CHAT, "edgespec": {"constraint": {"kind": "regex", "value": ""}}}, True, "edgespec.constraint.value"),
    ({**CHAT, "edgespec": {"constraint": {"kind": "xml"}}}, True, "edgespec.constraint.kind"),
    ({**CHAT, "edgespec": {"timeout_seconds": 0}}, True, "edgespec.timeout_seconds"),
    ({**CHAT, "edgespec": {"speed": 1}}, True, "edgespec.speed"),
    ({**CHAT, "edgespec": {"tree_depth": 17}}, True, "edgespec.tree_depth"),
    ({**CHAT, "model": "other"}, True, "model"),
    ({**CHAT, "logit_bias": {"1": 500}}, True, "logit_bias.1"),
    ({**CHAT, "logit_bias": {"one": 5}}, True, "logit_bias.one"),
    ({**CHAT, "logit_bias": [1, 5]}, True, "logit_bias"),
    ({**CHAT, "presence_penalty": 2.5}, True, "presence_penalty"),
    ({**CHAT, "frequency_penalty": "1"}, True, "frequency_penalty"),
    ({"model": "m", "prompt": [1, 2, 3]}, False, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, False, "prompt"),
    ({"model": "m", "prompt": "x", "top_logprobs": 2}, False, "top_logprobs"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, False, "logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, False, "messages"),
])
def test_bad_fields_are_named(body, chat, field):
    with pytest.raises(BadRequest) as e:
        parse(body, chat=chat)
    assert e.value.field == field


def test_bodies():
    st = SpecStats(target_forwards=2, emitted_tokens=3, cached_prompt_tokens=4)
    res = GenerationResult("hi!", [5, 6, 7], "eos", 10, st, logprobs=[TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.0)))])
    req = parse({**CHAT, "logprobs": True, "top_logprobs": 1})
    body = oa.completion_body(req, rid="chatcmpl-x", created=1, model="m", result=res, prompt_tokens=0,
                              timings=None, piece=lambda t: b"h" if t == 5 else "é".encode())
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["message"]["content"] == "hi!"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    lp = body["choices"][0]["logprobs"]["content"][0]
    assert lp["token"] == "h" and lp["bytes"] == [104] and lp["top_logprobs"][1]["bytes"] == [0xC3, 0xA9]
    assert body["edgespec"]["tau"] == 1.5
    assert oa.finish_reason("length") == "length" and oa.finish_reason("stop") == "stop"
    assert oa.chat_logprobs([TokenLogprob(5, float("-inf"))], lambda t: b"h")["content"][0]["logprob"] == -9999.0


def test_http_config_section_and_its_loopback_rule():
    cfg = load(None, env={"EDGESPEC_HTTP_ENABLED": "1", "EDGESPEC_HTTP_PORT": "9001"})
    assert cfg.http.enabled and cfg.http.port == 9001 and cfg.http.host == "127.0.0.1"
    assert not load(None, env={}).http.enabled
    with pytest.raises(InvalidConfig) as e:
        load(None, env={}, overrides={"http": {"enabled": True, "host": "0.0.0.0"}})
    assert [k for k, _ in e.value.problems] == ["http.host"]
    assert load(None, env={}, overrides={"http": {"enabled": True, "host": "0.0.0.0"},
                                         "server": {"insecure": True}}).http.host == "0.0.0.0"
    with pytest.raises(InvalidConfig) as e:
        load(None, env={}, overrides={"http": {"port": 70000}})
    assert [k for k, _ in e.value.problems] == ["http.port"]


def test_penalties_and_logit_bias_reach_the_sampling_params():
    req = oa.parse_request({**CHAT, "presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"7": -100, "3": 2.5}},
                        chat=True, policy=Policy(), models=["m"])
    s = req.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.logit_bias) == (0.5, -1.0, ((3, 2.5), (7, -100.0)))


def test_grpc_sampling_options_carry_penalties_and_logit_bias():
    from edgespec.proto.edgespec.v1 import inference_pb2 as pb
    from edgespec.server.convert import sampling_from

    s = sampling_from(pb.SamplingOptions(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={9: -1.5, 2: 3}),
                      Policy())
    assert (s.presence_penalty, s.frequency_penalty, s.logit_bias) == (0.5, 0.25, ((2, 3.0), (9, -1.5)))
    with pytest.raises(BadRequest) as e:
        sampling_from(pb.SamplingOptions(logit_bias={4: 200.0}), Policy())
    assert e.value.field == "sampling.logit_bias.4"
    assert sampling_from(pb.SamplingOptions(), Policy()).logit_bias == ()
