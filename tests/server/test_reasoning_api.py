"""Reasoning output through the HTTP APIs on the fake engine: a thinking model's <think> block is
chat completions' reasoning_content (unary, and streamed as its own deltas), a Responses
reasoning item and a Messages thinking block; a schema or a tool grammar holds after </think>;
reasoning_effort, chat_template_kwargs and Messages' thinking reach the chat template, and the
prompt's open block is read from it."""

from __future__ import annotations

import json

import grpc
import pytest

from tests.server.test_http import HTTP, MODEL, client, raw
from tests.server.test_tools_api import ADD

THINKING = ("<think>", "\nI add", " 1 and 2.\n", "</think>", "\n\n", "It is 3.")
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "1+2?"}], "max_tokens": 20}
# prints the template variables, and opens the block unless told not to think (as R1's and V3.1's do)
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "[effort={{ reasoning_effort | default('-') }}]<assistant>"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>\n{% endif %}")


def thinking(r, words=THINKING) -> None:
    r.engine.words, r.engine.eos_after = words, len(words)


def sse_events(out: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in out.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_chat_completions_split_reasoning_unary_and_streamed(make_daemon):
    r = make_daemon(http=HTTP, target={"reasoning_format": "think"})
    thinking(r)
    msg = client(r).chat.completions.create(**CHAT).choices[0].message
    assert (msg.reasoning_content, msg.content) == ("\nI add 1 and 2.\n", "It is 3.")
    status, _, out = raw(r, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(out) if e.get("choices")]
    assert status == 200
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nI add 1 and 2.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "It is 3."
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])  # reasoning first, tags never sent
    # a model that does not think: the format off, the answer all content
    r2 = make_daemon(http=HTTP)
    thinking(r2)
    msg = client(r2).chat.completions.create(**CHAT).choices[0].message
    assert msg.content.startswith("<think>") and getattr(msg, "reasoning_content", None) is None


def test_a_schema_and_a_tool_grammar_hold_after_the_reasoning(make_daemon):
    r = make_daemon(http=HTTP, target={"reasoning_format": "think"})
    thinking(r, ("<think>", "Sum.", "</think>", "\n", '{"a":', "3}"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    out = client(r).chat.completions.create(**CHAT, response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}).choices[0].message
    grammar = r.engine.requests[-1].constraint
    assert grammar.kind == "lark" and "THINK" in grammar.value and "%json" in grammar.value
    assert (out.reasoning_content, json.loads(out.content)) == ("Sum.", {"a": 3})

    thinking(r, ("<think>", "I call add.", "</think>", "\n\n", "<tool_call>\n",
                 '{"name":"add","arguments":{"a":1,"b":2}}', "\n</tool_call>"))
    resp = client(r).chat.completions.create(**CHAT, tools=[ADD])
    grammar = r.engine.requests[-1].constraint.value
    assert "THINK" in grammar and "<think>" in grammar and '"const": "add"' in grammar
    ch = resp.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.reasoning_content == "I call add."
    assert json.loads(ch.message.tool_calls[0].function.arguments) == {"a": 1, "b": 2}


def test_the_messages_api_answers_a_thinking_block(make_daemon):
    r = make_daemon(http=HTTP, target={"reasoning_format": "think"})
    thinking(r)
    body = {"model": MODEL, "max_tokens": 20, "messages": [{"role": "user", "content": "1+2?"}]}
    status, _, out = raw(r, "POST", "/v1/messages", body)
    blocks = json.loads(out)["content"]
    assert status == 200 and [b["type"] for b in blocks] == ["thinking", "text"]
    assert (blocks[0]["thinking"], blocks[1]["text"]) == ("\nI add 1 and 2.\n", "It is 3.")
    status, _, out = raw(r, "POST", "/v1/messages", {**body, "stream": True})
    events = sse_events(out)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    thought = "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta"
                      and e["delta"]["type"] == "thinking_delta")
    assert starts == ["thinking", "text"] and thought == "\nI add 1 and 2.\n"


def test_the_responses_api_answers_a_reasoning_item(make_daemon):
    r = make_daemon(http=HTTP, target={"reasoning_format": "think"})
    thinking(r)
    body = {"model": MODEL, "input": "1+2?", "max_output_tokens": 20}
    status, _, out = raw(r, "POST", "/v1/responses", body)
    items = json.loads(out)["output"]
    assert status == 200 and [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"][0]["text"] == "\nI add 1 and 2.\n"
    assert items[1]["content"][0]["text"] == "It is 3."
    events = sse_events(raw(r, "POST", "/v1/responses", {**body, "stream": True})[2])
    kinds = [e["type"] for e in events]
    assert "response.reasoning_text.delta" in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    done = events[-1]["response"]["output"]
    assert [i["type"] for i in done] == ["reasoning", "message"]


def test_the_request_reaches_the_template_and_its_prompt_opens_the_block(make_daemon, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    r = make_daemon(http=HTTP, target={"chat_template": str(path), "reasoning_format": "think"})
    opened = ("I add.", "</think>", "3")
    thinking(r, opened)
    msg = client(r).chat.completions.create(**CHAT, reasoning_effort="high").choices[0].message
    prompt = "".join(chr(t - 20) for t in r.engine.requests[-1].prompt_tokens if t >= 20)
    assert "[effort=high]" in prompt and prompt.endswith("<think>\n")
    assert (msg.reasoning_content, msg.content) == ("I add.", "3")  # the prompt opened the block
    msg = client(r).chat.completions.create(**CHAT, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.engine.requests[-1].prompt_tokens  # rendered with <think></think>: the answer is all content
    assert (getattr(msg.choices[0].message, "reasoning_content", None), msg.choices[0].message.content) == \
        (None, "I add.</think>3")
    status, _, out = raw(r, "POST", "/v1/messages", {"model": MODEL, "max_tokens": 20, "thinking": {
        "type": "disabled"}, "messages": [{"role": "user", "content": "1+2?"}]})
    assert [b["type"] for b in json.loads(out)["content"]] == ["text"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": "yes"}},
     "chat_template_kwargs.enable_thinking"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ("/v1/responses", {"model": MODEL, "input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
])
def test_bad_reasoning_fields_are_400_naming_them(make_daemon, path, body, param):
    r = make_daemon(http=HTTP)
    status, _, out = raw(r, "POST", path, body)
    assert status == 400 and json.loads(out)["error"]["param"] == param


# ---- the reasoning budget and the reasoning of earlier turns -------------------------------------


def test_a_reasoning_budget_reaches_the_engine_from_each_api(make_daemon):
    """edgespec.reasoning_budget, reasoning_effort minimal / low, Messages' thinking.budget_tokens
    and Responses' reasoning.effort become a budget on the <think> block (edgespec/budget.py)."""
    from edgespec.types import ReasoningBudget

    r = make_daemon(http=HTTP, target={"reasoning_format": "think"})
    thinking(r)

    def budget():
        c = r.engine.requests[-1].constraint
        return None if c is None else c.budget

    client(r).chat.completions.create(**CHAT, extra_body={"edgespec": {"reasoning_budget": 64}})
    assert budget() == ReasoningBudget(64)
    assert "THINK" in r.engine.requests[-1].constraint.value  # free text after the block
    client(r).chat.completions.create(**CHAT, reasoning_effort="low")
    assert budget() == ReasoningBudget(1024)
    client(r).chat.completions.create(**CHAT, reasoning_effort="high")
    assert budget() is None
    status, _, _ = raw(r, "POST", "/v1/messages", {"model": MODEL, "max_tokens": 20, "thinking": {
        "type": "enabled", "budget_tokens": 2048}, "messages": [{"role": "user", "content": "1+2?"}]})
    assert status == 200 and budget() == ReasoningBudget(2048)
    status, _, _ = raw(r, "POST", "/v1/responses", {"model": MODEL, "input": "1+2?", "reasoning": {"effort": "minimal"}})
    assert status == 200 and budget() == ReasoningBudget(256)
    status, _, out = raw(r, "POST", "/v1/messages", {"model": MODEL, "max_tokens": 20, "thinking": {
        "type": "enabled", "budget_tokens": 0}, "messages": [{"role": "user", "content": "1+2?"}]})
    assert status == 400 and "thinking.budget_tokens" in json.loads(out)["error"]["message"]
    status, _, out = raw(r, "POST", "/v1/chat/completions", {**CHAT, "edgespec": {"reasoning_budget": "x"}})
    assert status == 400 and json.loads(out)["error"]["param"] == "edgespec.reasoning_budget"


def test_earlier_reasoning_reaches_the_template_as_it_shows_it(make_daemon):
    """An assistant turn's reasoning (a Messages thinking block, a Responses reasoning item, chat's
    reasoning_content) is the template's reasoning_content: GLM 4.5's shows it after the last user
    turn (an agent's tool round trip) and drops it before."""
    from pathlib import Path

    glm = Path(__file__).parent.parent / "templates" / "glm-4.5.jinja"
    r = make_daemon(http=HTTP, target={"chat_template": str(glm), "reasoning_format": "think"})
    thinking(r, ("<think>", "ok", "</think>", "Done."))

    def prompt() -> str:
        return "".join(chr(t - 20) for t in r.engine.requests[-1].prompt_tokens if t >= 20)

    call = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"}
    thought = {"type": "thinking", "thinking": "I should add.", "signature": ""}
    msgs = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": [thought, call]},
            {"role": "user", "content": [result]}]
    body = {"model": MODEL, "max_tokens": 20, "tools": [{"name": "add", "input_schema": ADD["function"]["parameters"]}]}
    status, _, _ = raw(r, "POST", "/v1/messages", {**body, "messages": msgs})
    assert status == 200 and "<think>I should add.</think>" in prompt()
    status, _, _ = raw(r, "POST", "/v1/messages", {**body, "messages": [
        *msgs, {"role": "assistant", "content": "3."}, {"role": "user", "content": "And 2+2?"}]})
    assert status == 200 and "I should add." not in prompt()  # before the last user turn: dropped

    items = [{"role": "user", "content": "1+2?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "I should add."}]},
             {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a":1,"b":2}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "3"}]
    status, _, _ = raw(r, "POST", "/v1/responses", {"model": MODEL, "input": items, "tools": [
        {"type": "function", "name": "add", "parameters": ADD["function"]["parameters"]}]})
    assert status == 200 and "<think>I should add.</think>" in prompt()

    client(r).chat.completions.create(**{**CHAT, "messages": [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should add.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]}, tools=[ADD])
    assert "<think>I should add.</think>" in prompt()


def test_grpc_splits_the_reasoning_unary_and_streamed(make_daemon, tmp_path):
    """GenerateResponse.reasoning holds the <think> block, `text` the content; a stream's chunks
    carry each its pieces; ReasoningOptions reach the template and the budget the engine; an
    assistant turn's reasoning_content reaches the template."""
    from edgespec.proto.edgespec.v1 import inference_pb2 as pb
    from edgespec.types import ReasoningBudget

    r = make_daemon(target={"reasoning_format": "think"})
    thinking(r)
    req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="1+2?")],
                             sampling=pb.SamplingOptions(max_tokens=20))
    out = r.inference.Generate(req)
    assert (out.reasoning, out.text) == ("\nI add 1 and 2.\n", "It is 3.")
    msgs = list(r.inference.GenerateStream(req))
    assert "".join(m.reasoning for m in msgs) == "\nI add 1 and 2.\n" and "".join(m.text for m in msgs) == "It is 3."
    first_text = next(i for i, m in enumerate(msgs) if m.text)
    assert not any(m.reasoning for m in msgs[first_text:])
    assert r.engine.requests[-1].constraint is None
    r.inference.Generate(pb.GenerateRequest(messages=req.messages, sampling=req.sampling,
                                            reasoning=pb.ReasoningOptions(budget_tokens=99)))
    assert r.engine.requests[-1].constraint.budget == ReasoningBudget(99)
    r.inference.Generate(pb.GenerateRequest(messages=req.messages, sampling=req.sampling,
                                            reasoning=pb.ReasoningOptions(effort="minimal")))
    assert r.engine.requests[-1].constraint.budget == ReasoningBudget(256)
    for bad, field in ((pb.ReasoningOptions(effort="max"), "reasoning.effort"),
                       (pb.ReasoningOptions(budget_tokens=0), "reasoning.budget_tokens")):
        with pytest.raises(grpc.RpcError) as e:
            r.inference.Generate(pb.GenerateRequest(messages=req.messages, reasoning=bad))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE.replace("{{ m.content }}", "{{ m.reasoning_content | default('') }}{{ m.content }}"))
    r2 = make_daemon(target={"chat_template": str(path), "reasoning_format": "think"})
    thinking(r2, ("I add.", "</think>", "3"))
    out = r2.inference.Generate(pb.GenerateRequest(messages=[
        pb.ChatMessage(role="user", content="1+1?"), pb.ChatMessage(role="assistant", content="2",
                                                                    reasoning_content="Easy."),
        pb.ChatMessage(role="user", content="1+2?")], reasoning=pb.ReasoningOptions(effort="high")))
    prompt = "".join(chr(t - 20) for t in r2.engine.requests[-1].prompt_tokens if t >= 20)
    assert "Easy.2" in prompt and "[effort=high]" in prompt and prompt.endswith("<think>\n")
    assert (out.reasoning, out.text) == ("I add.", "3")  # the prompt opened the block
