"""End to end: `edgespec serve` as a real process on the demo models with the HTTP API on,
driven over loopback by the official `openai` client. Slow: CI runs it."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest

from edgespec.config import models_dir
from edgespec.server.auth import hash_token
from edgespec.server.config import DEMO_DRAFT, DEMO_TARGET
from tests.server.processes import start_http_daemon, stop

pytestmark = pytest.mark.slow
LOAD_TIMEOUT = 600
MODEL = DEMO_TARGET.removesuffix(".gguf")
KEY = "e2e-key"


class Server:
    def __init__(self, proc: subprocess.Popen, base: str, log: Path):
        self.proc, self.base, self.log = proc, base, log

    def client(self, key: str = KEY, retries: int = 0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=retries, timeout=300)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    if not ((models_dir() / DEMO_TARGET).is_file() and (models_dir() / DEMO_DRAFT).is_file()):
        pytest.skip("demo models missing: run `edgespec models prepare-demo`")
    d = tmp_path_factory.mktemp("http")
    (d / "tokens").write_text(hash_token(KEY) + "\n")
    proc, _, base = start_http_daemon(d, {
        "EDGESPEC_SERVER_GRACE_SECONDS": "30", "EDGESPEC_TARGET_N_CTX": "1024", "EDGESPEC_DRAFT_N_CTX": "1024",
        "EDGESPEC_SERVER_QUEUE_SIZE": "0", "EDGESPEC_AUTH_TOKENS_FILE": str(d / "tokens")}, parallel=1,
        load_timeout=LOAD_TIMEOUT)
    s = Server(proc, base, d / "serve.log")
    yield s
    stop(proc)


def test_chat_unary_and_stream_reassemble_chinese_exactly(server):
    c = server.client()
    msgs = [{"role": "user", "content": "请用中文回答：中国的首都是哪里？"}]
    resp = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    text = resp.choices[0].message.content
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text), text  # the demo model answers in Chinese
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens > 5 and 1 <= resp.usage.completion_tokens <= 24
    assert resp.model_extra["edgespec"]["target_forwards"] >= 1
    # plain: a token per chunk, so the reply is reassembled from many (a speculative stream, with the
    # suffix cache holding the unary reply, may come in two)
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"edgespec": {"mode": "plain"}}))
    pieces = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(pieces) == text  # greedy: the same reply, whatever the chunking
    assert len([p for p in pieces if p]) > 2
    assert all("\ufffd" not in p for p in pieces)  # no chunk ends inside a UTF-8 sequence
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_completions_models_and_tokenize(server):
    c = server.client()
    assert [m.id for m in c.models.list()] == [MODEL, f"{MODEL}-embedding", f"{MODEL}-rerank"]
    resp = c.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=8, temperature=0)
    assert resp.choices[0].text.startswith(" 6") and resp.usage.completion_tokens == 8
    assert resp.choices[0].finish_reason == "length"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=8, temperature=0, stream=True))
    assert streamed == resp.choices[0].text


def test_logprobs_from_the_engine(server):
    """Greedy: each token is its row's best, so it heads its own top_logprobs."""
    resp = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=8, temperature=0,
        logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob


def test_json_schema_response_format_validates(server):
    # bounded lengths: the object always closes within max_tokens
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**9}},
              "required": ["city", "population"], "additionalProperties": False}
    resp = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give the largest city of France as JSON."}],
        max_tokens=96, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content), schema)


def test_penalties_and_logit_bias_are_exact_under_speculation(server):
    """Greedy with presence / frequency / repetition penalties: chain and tree speak plain's words; logit_bias
    bans the token plain would have said; a bias outside the vocabulary is a 400 naming it."""
    from edgespec import backend

    c = server.client()
    msgs = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=32, temperature=0, frequency_penalty=1.5,
              presence_penalty=1.0)

    def say(mode: str, body: dict | None = None, **extra) -> str:
        return c.chat.completions.create(**{**kw, **extra}, extra_body={"edgespec": {"mode": mode}, **(body or {})}) \
            .choices[0].message.content

    plain = say("plain")
    assert say("chain") == plain and say("tree") == plain
    rep = {"repetition_penalty": 1.3}  # vLLM's extension field
    assert say("tree", rep) == say("plain", rep) != plain
    assert say("plain", frequency_penalty=0, presence_penalty=0) != plain  # the penalties bite
    model = backend.Model(models_dir() / DEMO_TARGET)
    try:
        six = model.tokenize(" 6", add_special=False)[0]
    finally:
        model.close()
    prompt = dict(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=4, temperature=0)
    assert c.completions.create(**prompt).choices[0].text.startswith(" 6")
    banned = c.completions.create(**prompt, logit_bias={str(six): -100}).choices[0].text
    assert not banned.startswith(" 6")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(**prompt, logit_bias={"9999999": 1})
    assert e.value.body["param"] == "logit_bias.9999999"


def test_bad_params_400_and_no_key_401(server):
    c = server.client()
    msgs = [{"role": "user", "content": "x"}]
    for kwargs, param in (({"n": 9}, "n"), ({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, **kwargs)
        assert e.value.body["param"] == param
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)


def anthropic_client(server: Server) -> anthropic.Anthropic:
    # retries: the client honours Retry-After while an earlier test's cancelled stream frees the one slot
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=8, timeout=300)


def test_anthropic_messages_unary_stream_and_stop_sequences(server):
    """The official `anthropic` client: greedy, the streamed text is the unary text; a stop
    sequence taken from that text ends the answer there and is named."""
    c = anthropic_client(server)
    kw = {"model": MODEL, "max_tokens": 24, "system": "You are a helpful assistant.",
          "messages": [{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
          "extra_body": {"temperature": 0}}
    msg = c.messages.create(**kw)
    text = msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and len(text) > 4
    assert msg.usage.input_tokens > 10 and 1 <= msg.usage.output_tokens <= 24
    assert c.messages.count_tokens(model=MODEL, system=kw["system"], messages=kw["messages"]).input_tokens == \
        msg.usage.input_tokens
    with c.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = c.messages.create(**kw, stop_sequences=["\u00a7\u00a7", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_anthropic_tool_round_trip(server):
    """tool_use then tool_result: a forced call's input validates against its input_schema,
    streamed (input_json_delta) as unary; its result goes back and the model answers in text."""
    c = anthropic_client(server)
    tool = {"name": "get_weather", "description": "The current weather in a city.", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = {"model": MODEL, "max_tokens": 48, "messages": ask, "tools": [tool],
          "tool_choice": {"type": "tool", "name": "get_weather"}, "extra_body": {"temperature": 0}}
    msg = c.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, tool["input_schema"])
    with c.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input == use.input

    history = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "Sunny, 24 degrees Celsius."}]}]
    answer = c.messages.create(model=MODEL, max_tokens=32, messages=history, tools=[tool],
                               tool_choice={"type": "none"}, extra_body={"temperature": 0})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text.strip()


def test_responses_unary_stream_and_function_tool(server):
    """The `openai` client's responses.create: greedy, the streamed text is the unary text; a
    forced function call's arguments validate, streamed as unary; its output goes back as an
    input item and the model answers in text."""
    c = server.client(retries=8)
    kw = {"model": MODEL, "instructions": "You are a helpful assistant.", "input": "Name three colours.",
          "max_output_tokens": 24, "temperature": 0}
    resp = c.responses.create(**kw)
    assert resp.status in ("completed", "incomplete") and len(resp.output_text) > 4
    events = list(c.responses.create(**kw, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text
    assert events[0].type == "response.created" and events[-1].response.output_text == resp.output_text

    tool = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                           "required": ["city"]}}
    ask = {"model": MODEL, "input": "What is the weather in Paris?", "tools": [tool], "max_output_tokens": 48,
           "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0}
    called = c.responses.create(**ask)
    (call,) = [o for o in called.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    streamed = list(c.responses.create(**ask, stream=True))
    assert "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta") == \
        call.arguments
    history = [{"role": "user", "content": ask["input"]}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees Celsius."}]
    answer = c.responses.create(model=MODEL, input=history, tools=[tool], tool_choice="none", max_output_tokens=32,
                                temperature=0)
    assert [o.type for o in answer.output] == ["message"] and answer.output_text.strip()


def test_overload_is_429(server):
    """parallel 1, queue 0: a second request while a stream holds the slot is refused."""
    c = server.client()
    stream = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=64, temperature=0, stream=True)
    it = iter(stream)
    next(it)  # the slot is taken
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert e.value.response.headers.get("retry-after") == "1"
    stream.close()


def test_sigterm_mid_stream_ends_the_stream_cleanly(server):
    """Last in this module: it stops the daemon."""
    # retries: the client honours Retry-After while the previous test's cancelled stream frees the slot
    stream = server.client(retries=8).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell a story."}], max_tokens=24, temperature=0,
        stream=True)
    it = iter(stream)
    first = next(it)
    server.proc.send_signal(signal.SIGTERM)
    rest = list(it)  # ends without an error: the in-flight stream finishes within the grace period
    finals = [ch.choices[0].finish_reason for ch in [first, *rest] if ch.choices and ch.choices[0].finish_reason]
    assert finals and finals[-1] in ("stop", "length")
    assert server.proc.wait(60) == 0
