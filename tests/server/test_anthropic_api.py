"""Anthropic's Messages API over real loopback sockets with the fake engine, driven by the
official `anthropic` client and raw HTTP: unary and streamed answers (the documented event
sequence), tool_use / tool_result, sampling fields, count_tokens, x-api-key auth and Anthropic's
error body naming Anthropic's fields."""

from __future__ import annotations

import json

import anthropic
import pytest

from edgespec.server.auth import hash_token
from tests.server.test_http import HTTP, MODEL, raw
from tests.server.test_tools_api import CALL, PIECES

ADD = {"name": "add", "description": "a + b", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
MSGS = [{"role": "user", "content": "Hello"}]


def client(r, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{r.daemon.http_port}", api_key=key, max_retries=0,
                               timeout=30)


def events(out: bytes) -> list[tuple[str, dict]]:
    """(event name, data) of an Anthropic stream, read as the wire has it."""
    got = []
    for block in out.decode().split("\n\n"):
        lines = dict(ln.split(": ", 1) for ln in block.splitlines() if ": " in ln and not ln.startswith(":"))
        if "event" in lines:
            data = json.loads(lines["data"])
            assert data["type"] == lines["event"]
            got.append((lines["event"], data))
    return got


def prompt_text(ids) -> str:
    """The fake encoder's tokens (ord(c) % 200 + 20 after a BOS) back as text (ASCII only)."""
    return "".join(chr(t - 20) for t in ids[1:])


def test_unary_and_stream_agree(make_daemon):
    r = make_daemon(http=HTTP)
    c = client(r)
    kw = {"model": MODEL, "max_tokens": 7, "messages": MSGS, "system": "Be brief."}
    msg = c.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "alpha beta gamma delta alpha beta gamma "
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 7 and msg.usage.input_tokens > 0
    assert "Be brief." in prompt_text(r.engine.requests[0].prompt_tokens)  # the system prompt reached the template

    with c.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text and final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 7
    assert final.usage.input_tokens == msg.usage.input_tokens

    status, headers, out = raw(r, "POST", "/v1/messages", {**kw, "temperature": 0, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    names = [n for n, _ in events(out)]
    deltas = names.count("content_block_delta")
    assert deltas > 1  # really streamed
    assert names == ["message_start", "ping", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    last = events(out)[-2][1]
    assert last["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} and last["usage"]["output_tokens"] == 7


def test_end_turn_sampling_fields_and_stop_sequences_reach_the_engine(make_daemon):
    r = make_daemon(http=HTTP)
    r.engine.eos_after = 3
    # the client no longer names temperature, top_p and top_k; the API still takes them
    msg = client(r).messages.create(model=MODEL, max_tokens=20, messages=MSGS, stop_sequences=["zz", "yy"],
                                    metadata={"user_id": "u1"}, output_config={"effort": "low"},
                                    extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
    assert msg.stop_reason == "end_turn" and msg.content[0].text == "alpha beta gamma "
    s = r.engine.requests[0].sampling
    assert (s.temperature, s.top_p, s.top_k, s.stop, s.max_tokens) == (0.5, 0.9, 5, ("zz", "yy"), 20)


def test_content_blocks_tool_use_and_tool_result_round_trip(make_daemon):
    r = make_daemon(http=HTTP)
    r.engine.words, r.engine.eos_after = CALL, 3
    c = client(r)
    ask = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "1+2?"}]}]
    msg = c.messages.create(model=MODEL, max_tokens=20, messages=ask, tools=[ADD])
    assert r.engine.requests[0].constraint.kind == "lark"
    assert msg.stop_reason == "tool_use"
    (use,) = msg.content
    assert use.type == "tool_use" and use.name == "add" and use.input == {"a": 1, "b": 2}
    assert use.id.startswith("toolu_")
    assert "What is\n\n1+2?" in prompt_text(r.engine.requests[0].prompt_tokens)

    # the round trip: the call and its result go back; tool_choice none answers text
    r.engine.words, r.engine.eos_after = ("three",), 1
    history = [*ask, {"role": "assistant", "content": msg.model_dump()["content"]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "3"}]}]
    answer = c.messages.create(model=MODEL, max_tokens=20, messages=history, tools=[ADD],
                               tool_choice={"type": "none"})
    assert answer.stop_reason == "end_turn" and answer.content[0].text == "three"
    prompt = prompt_text(r.engine.requests[1].prompt_tokens)
    assert '{"name":"add","arguments":{"a":1,"b":2}}' in prompt and "<tool>3" in prompt


def test_tool_use_streams_as_input_json_deltas(make_daemon):
    r = make_daemon(http=HTTP)
    r.engine.words, r.engine.eos_after = PIECES, 7
    c = client(r)
    kw = {"model": MODEL, "max_tokens": 20, "messages": MSGS, "tools": [ADD],
          "tool_choice": {"type": "tool", "name": "add", "disable_parallel_tool_use": True}}
    with c.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == {"a": 1, "b": 2}
    assert "TEXT | calls" not in r.engine.requests[0].constraint.value  # a named tool: calls only

    status, _, out = raw(r, "POST", "/v1/messages", {**kw, "stream": True})
    evs = events(out)
    assert status == 200
    starts = [d["content_block"] for n, d in evs if n == "content_block_start"]
    assert [(b["type"], b["name"], b["input"]) for b in starts] == [("tool_use", "add", {})]
    parts = [d["delta"] for n, d in evs if n == "content_block_delta"]
    assert all(p["type"] == "input_json_delta" for p in parts) and len(parts) == 3  # as the model wrote them
    assert json.loads("".join(p["partial_json"] for p in parts)) == {"a": 1, "b": 2}
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_count_tokens_is_the_prompt_the_engine_reads(make_daemon):
    r = make_daemon(http=HTTP)
    c = client(r)
    kw = {"model": MODEL, "messages": MSGS, "system": [{"type": "text", "text": "Be brief."}], "tools": [ADD]}
    counted = c.messages.count_tokens(**kw)
    msg = c.messages.create(**kw, max_tokens=2)
    assert counted.input_tokens == msg.usage.input_tokens == len(r.engine.requests[0].prompt_tokens)
    assert c.messages.count_tokens(model=MODEL, messages=MSGS).input_tokens < counted.input_tokens


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"stop_sequences": [""]}, "stop_sequences[0]"),
    ({"stop_sequences": "zz"}, "stop_sequences"),
    ({"system": [{"type": "image"}]}, "system[0].type"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]}]},
     "messages[0].content[0].input"),
    ({"tools": [{"name": "a b", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools[0].input_schema.type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [ADD], "tool_choice": {"type": "tool", "name": "sub"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "maybe"}}, "tool_choice.type"),
    ({"edgespec": {"mode": "fast"}}, "edgespec.mode"),
    ({"output_config": {"format": {"type": "json_schema", "schema": 1}}}, "output_config.format.schema"),
])
def test_bad_fields_are_400_in_anthropics_shape_naming_them(make_daemon, body, field):
    r = make_daemon(http=HTTP)
    status, _, out = raw(r, "POST", "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": MSGS, **body})
    err = json.loads(out)
    assert status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(field + ": ")


def test_another_models_name_is_answered_unless_strict(make_daemon):
    """A client written for Anthropic's service works with only its base URL changed."""
    msg = client(make_daemon(http=HTTP)).messages.with_raw_response.create(model="claude-9", max_tokens=4,
                                                                           messages=MSGS)
    assert msg.parse().model == MODEL
    assert msg.headers["x-edgespec-warning"] == f"model 'claude-9' is not served here: {MODEL} answered"
    r = make_daemon(http={**HTTP, "strict": True})
    with pytest.raises(anthropic.NotFoundError) as e:
        client(r).messages.create(model="claude-9", max_tokens=4, messages=MSGS)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-9" in e.value.body["error"]["message"]
    status, _, out = raw(r, "GET", "/v1/messages")
    assert status == 405 and json.loads(out)["type"] == "error"


def test_x_api_key_and_bearer_are_the_same_identities(make_daemon, tmp_path):
    f = tmp_path / "tokens"
    f.write_text("alice:" + hash_token("s3cret") + "\n")
    r = make_daemon(http=HTTP, auth={"tokens_file": str(f)})
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(r, "wrong").messages.create(model=MODEL, max_tokens=2, messages=MSGS)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    assert client(r, "s3cret").messages.create(model=MODEL, max_tokens=2, messages=MSGS).content  # x-api-key
    bearer = anthropic.Anthropic(base_url=f"http://127.0.0.1:{r.daemon.http_port}", auth_token="s3cret",
                                 max_retries=0, timeout=30)
    assert bearer.messages.create(model=MODEL, max_tokens=2, messages=MSGS).content
    status, _, _ = raw(r, "GET", "/v1/models", headers={"x-api-key": "s3cret"})  # the OpenAI routes take it too
    assert status == 200


def test_unknown_fields_are_ignored_by_default_and_named(make_daemon):
    r = make_daemon(http=HTTP)
    body = {"model": MODEL, "max_tokens": 2, "messages": MSGS, "container": "x", "thinking": {"type": "disabled"}}
    status, headers, _ = raw(r, "POST", "/v1/messages", body)
    assert status == 200 and headers["x-edgespec-warning"] == "ignored unknown fields: container"
    strict = make_daemon(http={**HTTP, "strict": True})
    status, _, out = raw(strict, "POST", "/v1/messages", body)
    assert status == 400 and json.loads(out)["error"]["message"].startswith("container: ")


def test_an_error_after_the_status_line_is_an_error_event(make_daemon):
    r = make_daemon(http=HTTP, step_seconds=0.01)
    body = {"model": MODEL, "max_tokens": 4000, "messages": MSGS, "stream": True, "edgespec": {"timeout_seconds": 0.2}}
    status, _, out = raw(r, "POST", "/v1/messages", body)
    evs = events(out)
    assert status == 200 and evs[0][0] == "message_start"
    name, data = evs[-1]
    assert name == "error" and data["error"]["type"] == "timeout_error" and "timeout_seconds" in data["error"]["message"]
