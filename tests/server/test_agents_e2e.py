"""Agents against a real daemon (the demo models, loopback, one daemon for the module): tool
calling with the official `openai` client (a round trip, streamed deltas, tool_choice required
on several tools with every call validated against its schema), langchain-openai's
bind_tools, and the OpenAI Agents SDK's default model class (the Responses API). Slow: CI runs it."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest

from tests.server import test_http_e2e
from tests.server.test_http_e2e import KEY, MODEL

server = test_http_e2e.server  # that module's daemon fixture, started again for this module

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {
    "name": "book_room", "description": "Book a meeting room",
    "parameters": {"type": "object", "properties": {
        "room": {"type": "string", "pattern": "^[A-Z][0-9]{3}$"},
        "attendees": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        "hours": {"type": "number", "minimum": 0.5, "maximum": 8}},
        "required": ["room", "attendees", "hours"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def test_tool_round_trip_with_the_openai_client(server):
    c = server.client()
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=40, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS["get_weather"])
    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    final = c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none",
                                      max_tokens=16, temperature=0)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content and not final.choices[0].message.content.startswith("<tool_call>")
    assert final.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_call_deltas_assemble(server):
    c = server.client()
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Add 2 and 3."}],
          "tools": [ADD], "tool_choice": "required", "max_tokens": 40, "temperature": 0}
    unary = c.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        for d in ch.delta.tool_calls or ():
            slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
            slot["id"] = d.id or slot["id"]
            if d.function is not None:
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
                slot["pieces"] += bool(d.function.arguments)
    assert finish in ("tool_calls", "length")  # the demo model may repeat its call up to max_tokens
    assert calls
    whole = [s for _, s in sorted(calls.items())][:len(unary)]  # (a call cut short by max_tokens: not in unary)
    assert [(s["name"], s["arguments"]) for s in whole] == \
        [(u.function.name, u.function.arguments) for u in unary]  # greedy: the same calls, the same text
    for s in whole:
        assert s["id"].startswith("call_")
        assert s["pieces"] >= 2  # the arguments streamed as they were written, not in one piece at the end
        jsonschema.validate(json.loads(s["arguments"]), SCHEMAS[s["name"]])


@pytest.mark.parametrize("mode", ["plain", "tree"])
def test_required_calls_always_parse_and_validate(server, mode):
    c = server.client()
    prompts = ["Book room B204 for Ann and Bo for two hours.", "Tell me a joke."]
    n = 0
    for i, p in enumerate(prompts):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], tools=TOOLS,
                                      tool_choice="required", parallel_tool_calls=i % 2 == 0, max_tokens=96,
                                      temperature=0.8, seed=i, extra_body={"edgespec": {"mode": mode}})
        ch = r.choices[0]
        assert ch.finish_reason in ("tool_calls", "length"), (p, ch)
        if ch.finish_reason == "tool_calls":
            assert ch.message.tool_calls, (p, ch)
        else:  # a sample may fill max_tokens inside a call (a long array): what came is a call's start
            assert (ch.message.content or "").startswith("<tool_call>") or ch.message.tool_calls, (p, ch)
        assert i % 2 == 0 or len(ch.message.tool_calls or ()) <= 1
        for call in ch.message.tool_calls or ():  # every call returned is whole and valid
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            n += 1
    assert n >= 1


def test_named_tool_choice_calls_that_tool(server):
    c = server.client()
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}], tools=TOOLS,
                                  tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=48,
                                  temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["add"])


def test_langchain_bind_tools_calls_a_tool(server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """The current weather in a city."""
        return f"18 degrees {unit} in {city}"

    llm = lc.ChatOpenAI(model=MODEL, base_url=server.base + "/v1", api_key="e2e-key", temperature=0, max_tokens=48,
                        max_retries=0)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("How warm is it in Oslo?")
    assert len(msg.tool_calls) == 1, msg
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo", "Lima")
    assert get_weather.invoke(call["args"]).startswith("18 degrees")


def test_embeddings_with_the_openai_client(server):
    import numpy as np

    c = server.client()
    sentences = ["The cat sat on the mat.", "A cat was sitting on the mat.",
                 "Quarterly revenue grew by ten percent.", "The invoice is due at the end of the month."]
    r = c.embeddings.create(model=MODEL, input=sentences)  # the client asks for base64 and decodes it
    v = np.array([d.embedding for d in r.data])
    assert v.shape == (4, 576) and [d.index for d in r.data] == [0, 1, 2, 3]
    assert np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-4)
    sim = v @ v.T
    assert sim[0, 1] > max(sim[0, 2], sim[0, 3], sim[1, 2], sim[1, 3])  # near-duplicates closest
    assert r.usage.prompt_tokens > 20
    floats = c.embeddings.create(model=MODEL, input=sentences[0], encoding_format="float")
    # alone and batched: the same vector up to the batch shape's float rounding; float = base64
    assert float(np.dot(floats.data[0].embedding, v[0])) > 0.9999
    import urllib.request

    ask = urllib.request.Request(server.base + "/tokenize", data=json.dumps({"prompt": sentences[0]}).encode(),
                                 headers={"Authorization": "Bearer e2e-key", "Content-Type": "application/json"})
    ids = json.loads(urllib.request.urlopen(ask, timeout=60).read())["tokens"]
    tok = c.embeddings.create(model=MODEL, input=[ids], encoding_format="float")
    assert np.allclose(tok.data[0].embedding, floats.data[0].embedding, atol=1e-6)  # token ids = the text


def test_openai_agents_sdk_runs_a_tool_using_agent(server):
    """The Agents SDK with its default model class (OpenAIResponsesModel: POST /v1/responses) and
    only the base URL changed: the agent calls the tool (forced: the demo model is too small to
    choose it, and once shown a result it calls again), the SDK runs it, and the conversation with
    the call and its output as input items goes back for a text answer."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=8),
                                     use_for_tracing=False)
    agents.set_default_openai_api("responses")
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"Sunny, 24 degrees Celsius in {city}."

    settings = {"temperature": 0, "max_tokens": 48}
    caller = agents.Agent(name="weather", instructions="Answer questions about the weather with the tool.",
                          tools=[get_weather], model=MODEL, tool_use_behavior="stop_on_first_tool",
                          model_settings=agents.ModelSettings(tool_choice="get_weather", **settings))
    called = agents.Runner.run_sync(caller, "What is the weather in Paris?", max_turns=2)
    assert len(cities) == 1 and cities[0] and called.final_output == f"Sunny, 24 degrees Celsius in {cities[0]}."
    items = called.to_input_list()
    assert [i.get("type") for i in items[1:]] == ["function_call", "function_call_output"]

    answerer = caller.clone(tool_use_behavior="run_llm_again",
                            model_settings=agents.ModelSettings(tool_choice="none", **settings))
    answered = agents.Runner.run_sync(answerer, items, max_turns=2)
    assert isinstance(answered.final_output, str) and answered.final_output.strip() and len(cities) == 1
