"""OpenAI's Responses API over real loopback sockets with the fake engine, driven by the official
`openai` client's responses.create and raw HTTP: unary and streamed answers (the documented event
sequence), function tools and their outputs, text.format, statelessness, and field errors that
name the Responses field."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.test_anthropic_api import prompt_text
from tests.server.test_http import HTTP, MODEL, client, raw
from tests.server.test_tools_api import CALL, PIECES

ADD = {"type": "function", "name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}


def test_unary_and_stream_agree(make_daemon):
    r = make_daemon(http=HTTP)
    c = client(r)
    kw = {"model": MODEL, "input": "Hello", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0}
    resp = c.responses.create(**kw)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert resp.output_text == "alpha beta gamma delta alpha beta gamma "
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 7 and resp.usage.total_tokens == resp.usage.input_tokens + 7
    assert resp.store is False and resp.instructions == "Be brief."
    assert "Be brief." in prompt_text(r.engine.requests[0].prompt_tokens)

    events = list(c.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1  # really streamed
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == resp.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 7

    r.engine.eos_after = 3
    done = c.responses.create(model="gpt-9", input=[{"role": "user", "content": "Hi"}], max_output_tokens=20)
    assert done.status == "completed" and done.incomplete_details is None and done.output_text == "alpha beta gamma "
    assert done.model == MODEL  # the served model answers whatever the name
    s = r.engine.requests[-1].sampling
    assert (s.max_tokens, s.temperature) == (20, 1.0)


def test_function_tool_call_and_its_output_round_trip(make_daemon):
    r = make_daemon(http=HTTP)
    r.engine.words, r.engine.eos_after = CALL, 3
    c = client(r)
    ask = [{"role": "user", "content": [{"type": "input_text", "text": "1+2?"}]}]
    resp = c.responses.create(model=MODEL, input=ask, tools=[ADD])
    assert r.engine.requests[0].constraint.kind == "lark"
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and resp.status == "completed"

    r.engine.words, r.engine.eos_after = ("three",), 1
    history = [*ask, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "3"}]
    answer = c.responses.create(model=MODEL, input=history, tools=[ADD], tool_choice="none")
    assert answer.output_text == "three" and [o.type for o in answer.output] == ["message"]
    prompt = prompt_text(r.engine.requests[1].prompt_tokens)
    assert '{"name":"add","arguments":{"a":1,"b":2}}' in prompt and "<tool>3" in prompt


def test_function_call_arguments_stream_in_pieces(make_daemon):
    r = make_daemon(http=HTTP)
    r.engine.words, r.engine.eos_after = PIECES, 7
    events = list(client(r).responses.create(model=MODEL, input="1+2?", tools=[ADD], stream=True,
                                             tool_choice={"type": "function", "name": "add"}))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * 3, "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    added = events[2].item
    assert added.type == "function_call" and added.name == "add" and added.arguments == ""
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[6].arguments == events[-1].response.output[0].arguments == '{"a":1,"b":2}'


def test_text_format_json_schema_is_the_constraint(make_daemon):
    r = make_daemon(http=HTTP)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    resp = client(r).responses.create(model=MODEL, input="JSON please", max_output_tokens=4, text={
        "format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    c = r.engine.requests[0].constraint
    assert c.kind == "json_schema" and json.loads(c.value) == schema
    assert resp.text.format.type == "json_schema"


def test_previous_response_id_is_refused_by_name(make_daemon):
    r = make_daemon(http=HTTP)
    with pytest.raises(openai.BadRequestError) as e:
        client(r).responses.create(model=MODEL, input="Hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and "stateless" in e.value.body["message"]
    assert not r.engine.requests


@pytest.mark.parametrize("body, param", [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice.name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
])
def test_bad_fields_are_400_naming_them(make_daemon, body, param):
    r = make_daemon(http=HTTP)
    status, _, out = raw(r, "POST", "/v1/responses", {"model": MODEL, "input": "x", **body})
    err = json.loads(out)["error"]
    assert status == 400 and err["param"] == param and err["type"] == "invalid_request_error", err


def test_an_error_after_the_status_line_is_an_error_event(make_daemon):
    r = make_daemon(http=HTTP, step_seconds=0.01)
    body = {"model": MODEL, "input": "x", "max_output_tokens": 4000, "stream": True,
            "edgespec": {"timeout_seconds": 0.2}}
    status, _, out = raw(r, "POST", "/v1/responses", body)
    datas = [json.loads(ln[6:]) for ln in out.decode().splitlines() if ln.startswith("data: ")]
    assert status == 200 and datas[0]["type"] == "response.created"
    assert datas[-1]["type"] == "error" and datas[-1]["code"] == "deadline_exceeded"
    assert datas[-1]["sequence_number"] == len(datas) - 1
