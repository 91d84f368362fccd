"""Tool calling through both APIs on the fake engine: the request's tools become the grammar the
engine gets, the answer's blocks become tool_calls (unary and streamed, OpenAI's delta shape),
and bad tool fields are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from edgespec.proto.edgespec.v1 import inference_pb2 as pb
from tests.server.test_http import HTTP, MODEL, client, raw

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALL = ("<tool_call>\n", '{"name":"add","arguments":{"a":1,"b":2}}', "\n</tool_call>", "\n")


def calling(r) -> None:
    r.engine.words = CALL  # the fake model answers with one call of add, then end of sequence
    r.engine.eos_after = 3


def test_http_tool_call_unary_and_streamed(make_daemon):
    r = make_daemon(http=HTTP)
    calling(r)
    c = client(r)
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "1+2?"}], "tools": [ADD], "max_tokens": 20}
    resp = c.chat.completions.create(**kw)
    req = r.engine.requests[0]
    assert req.constraint.kind == "lark" and '"const": "add"' in req.constraint.value
    ch = resp.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "add", {"a": 1, "b": 2})

    chunks = list(c.chat.completions.create(**kw, stream=True))
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or ()]
    assert [d.index for d in deltas] == [0, 0]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "add" and deltas[0].function.arguments == ""
    assert json.loads(deltas[1].function.arguments) == {"a": 1, "b": 2}
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)  # the tag was never text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        ["tool_calls"]


# one call written over several tokens, as a model writes it
PIECES = ("<tool_call>\n", '{"name":"add",', '"arguments":{"a"', ":1,", '"b":2', "}}", "\n</tool_call>", "\n")


def test_http_streamed_arguments_come_in_pieces_per_choice(make_daemon):
    r = make_daemon(http=HTTP, server={"parallel": 2})
    r.engine.words, r.engine.eos_after = PIECES, 7
    c = client(r)
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "1+2?"}], "tools": [ADD], "max_tokens": 20, "n": 2}
    unary = c.chat.completions.create(**kw)
    calls: dict[int, list] = {0: [], 1: []}
    finishes: dict[int, list] = {0: [], 1: []}
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            assert not ch.delta.content  # the tag and the JSON around the arguments are never text
            calls[ch.index] += ch.delta.tool_calls or []
            finishes[ch.index] += [ch.finish_reason] if ch.finish_reason else []
    for i in (0, 1):
        head, *frags = calls[i]
        assert head.id.startswith("call_") and head.function.name == "add" and head.function.arguments == ""
        assert len(frags) == 3 and all(d.index == 0 and d.id is None for d in frags)  # as the model wrote them
        args = "".join(d.function.arguments for d in frags)
        assert args == unary.choices[i].message.tool_calls[0].function.arguments == '{"a":1,"b":2}'
        assert finishes[i] == ["tool_calls"]


def test_http_tool_choice_none_answers_text_and_history_calls_are_accepted(make_daemon):
    r = make_daemon(http=HTTP)
    calling(r)
    msgs = [{"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    resp = client(r).chat.completions.create(model=MODEL, messages=msgs, tools=[ADD], tool_choice="none", max_tokens=20)
    assert resp.choices[0].message.tool_calls is None  # none: nothing is parsed
    assert "(<tool_call>)" in r.engine.requests[0].constraint.value and "call_body" not in \
        r.engine.requests[0].constraint.value


@pytest.mark.parametrize("body, param", [
    ({"tools": [ADD], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice.function.name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add",
                                                                                        "arguments": "{"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, "messages[0].tool_calls"),
])
def test_http_bad_tool_fields_are_400_naming_them(make_daemon, body, param):
    r = make_daemon(http=HTTP)
    status, _, out = raw(r, "POST", "/v1/chat/completions",
                         {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body})
    assert status == 400 and json.loads(out)["error"]["param"] == param


def test_completions_refuse_tools(make_daemon):
    r = make_daemon(http=HTTP)
    status, _, out = raw(r, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "tools": [ADD]})
    assert status == 400 and json.loads(out)["error"]["param"] == "tools"


def _grpc_req(**tools) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="1+2?")],
                              sampling=pb.SamplingOptions(max_tokens=20), tools=pb.ToolOptions(**tools))


def test_grpc_tool_call_unary_and_stream(make_daemon):
    r = make_daemon()
    calling(r)
    tool = pb.Tool(name="add", parameters_json=json.dumps(ADD["function"]["parameters"]))
    out = r.inference.Generate(_grpc_req(tools=[tool], choice="required"))
    assert out.finish_reason == pb.TOOL_CALLS
    (call,) = out.tool_calls
    assert call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2} and call.id.startswith("call_")
    assert "TEXT | calls" not in r.engine.requests[0].constraint.value  # required: calls only
    msgs = list(r.inference.GenerateStream(_grpc_req(tools=[tool])))
    assert "".join(m.text for m in msgs).startswith("<tool_call>")
    assert msgs[-1].finish_reason == pb.TOOL_CALLS and [c.name for c in msgs[-1].tool_calls] == ["add"]
    # the history of a round trip
    hist = pb.GenerateRequest(messages=[
        pb.ChatMessage(role="user", content="1+2?"),
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id=call.id, name="add", arguments=call.arguments)]),
        pb.ChatMessage(role="tool", tool_call_id=call.id, content="3")],
        sampling=pb.SamplingOptions(max_tokens=20), tools=pb.ToolOptions(tools=[tool], choice="none"))
    assert not r.inference.Generate(hist).tool_calls


@pytest.mark.parametrize("tools, field", [
    ({"tools": [pb.Tool(name="a b")]}, "tools.tools[0].name"),
    ({"tools": [pb.Tool(name="f", parameters_json="{")]}, "tools.tools[0].parameters_json"),
    ({"tools": [pb.Tool(name="f")], "choice": "g"}, "tools.choice"),
    ({"choice": "required"}, "tools.choice"),
])
def test_grpc_bad_tool_fields_are_invalid_argument_naming_them(make_daemon, tools, field):
    r = make_daemon()
    with pytest.raises(grpc.RpcError) as e:
        r.inference.Generate(_grpc_req(**tools))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


# Qwen3-Coder's XML, written over several tokens
QWEN3_CODER = ("<tool_call>\n<function=add>\n", "<parameter=a>\n1\n</parameter>\n", "<parameter=b>\n2",
               "\n</parameter>\n", "</function>\n</tool_call>", "\n")


def test_a_forced_format_is_the_grammar_and_the_parser_of_every_api(make_daemon):
    """[target] tool_format = qwen3_coder: the engine gets that format's grammar, and the answer
    in that format is a call in chat completions (unary and streamed in pieces), the Messages
    API and gRPC."""
    r = make_daemon(http=HTTP, target={"tool_format": "qwen3_coder"})
    r.engine.words, r.engine.eos_after = QWEN3_CODER, 5
    c = client(r)
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "1+2?"}], "tools": [ADD], "max_tokens": 20}
    resp = c.chat.completions.create(**kw)
    assert "<function=add>" in r.engine.requests[0].constraint.value
    (call,) = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    deltas = [d for ch in c.chat.completions.create(**kw, stream=True) if ch.choices
              for d in ch.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name == "add" and len(deltas) > 2  # the header, then the arguments in pieces
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"a": 1, "b": 2}

    status, _, out = raw(r, "POST", "/v1/messages", {
        "model": MODEL, "max_tokens": 20, "messages": [{"role": "user", "content": "1+2?"}],
        "tools": [{"name": "add", "input_schema": ADD["function"]["parameters"]}]})
    body = json.loads(out)
    assert status == 200 and body["stop_reason"] == "tool_use"
    assert [(b["name"], b["input"]) for b in body["content"] if b["type"] == "tool_use"] == [("add", {"a": 1, "b": 2})]

    tool = pb.Tool(name="add", parameters_json=json.dumps(ADD["function"]["parameters"]))
    out = r.inference.Generate(_grpc_req(tools=[tool], choice="required"))
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("add", {"a": 1, "b": 2})]


def test_the_format_is_the_one_the_configured_template_writes(make_daemon):
    glm = Path(__file__).parents[1] / "templates" / "glm-4.5.jinja"
    r = make_daemon(http=HTTP, target={"chat_template": str(glm)})
    r.engine.words = ("<tool_call>add\n", "<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n",
                      "<arg_key>b</arg_key>\n<arg_value>2</arg_value>\n", "</tool_call>")
    r.engine.eos_after = 4
    resp = client(r).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1+2?"}],
                                             tools=[ADD], max_tokens=20)
    assert "<arg_key>a</arg_key>" in r.engine.requests[0].constraint.value
    (call,) = resp.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 1, "b": 2})
