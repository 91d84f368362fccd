"""Tool-call formats of the model families (edgespec.tool_formats): each detected from its real
chat template (tests/templates), a call rendered by that template parsed back to the same name
and arguments, every parser fed one character at a time, and the grammar keeping every call's
arguments valid: what it refuses, and walks under its mask (a model that would rather write
broken arguments, greedy and at random) that always end in calls that parse and validate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from edgespec import chat, tool_formats, tools
from edgespec.constraint import Compiler, Vocabulary
from edgespec.errors import BadRequest

TEMPLATES = Path(__file__).parent / "templates"
EOS = 256
BYTES = tuple(bytes([i]) for i in range(256)) + (b"\xff<eos>",)
FORMATS = tool_formats.FORMATS[1:]  # hermes is tests/test_tools.py's


def _tokenize(s: str) -> list[int]:
    return list(s.encode())


@pytest.fixture(scope="module")
def compiler() -> Compiler:
    return Compiler(Vocabulary(BYTES, (EOS,), (EOS,), None, _tokenize))


WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1},
    "metric": {"type": "boolean"}, "where": {"type": "object", "properties": {"lat": {"type": "number"}},
                                             "required": ["lat"]}},
    "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
ADD_PARAMS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD_PARAMS}}
SCHEMAS = {"get_weather": {**WEATHER_PARAMS, "additionalProperties": False},
           "add": {**ADD_PARAMS, "additionalProperties": False}}
CALLS = [("get_weather", {"city": "Oslo\nnorth <b>", "unit": "c", "days": 3, "metric": True, "where": {"lat": 59.9}}),
         ("add", {"a": 2, "b": -3})]


def spec(fmt: str, choice=None, parallel=None) -> tools.ToolSpec:
    s = tools.parse_tools([WEATHER, ADD], choice, parallel, fmt)
    assert s is not None
    return s


def calls_of(fmt: str) -> list:
    f = tool_formats.by_name(fmt)
    assert f is not None, fmt
    return CALLS if f.parallel else CALLS[:1]


def accepts(compiler: Compiler, s: tools.ToolSpec, text: str) -> bool:
    m = compiler.matcher(s.constraint())
    toks = _tokenize(text)
    if not m.allows(toks):
        return False
    m.commit(toks)
    return m.accepting


def streamed(s: tools.ToolSpec, pieces: list[str]) -> tuple[str, dict[int, list], list]:
    """(content, {index: [name, arguments]}, calls) as a stream fed `pieces` sends them."""
    st = s.stream()
    events = [ev for p in pieces for ev in st.feed(p)] + st.finish()
    content, got = "", dict[int, Any]()
    for kind, v in events:
        if kind == "content":
            content += v
        elif v.id is not None:
            assert v.index == len(got) and v.name and not v.arguments
            got[v.index] = [v.name, ""]
        else:
            got[v.index][1] += v.arguments
    return content, got, st.calls


# ---- the real templates ------------------------------------------------------------------------

# file -> (format, shows tools itself, where its calls end in the rendered text)
FAMILIES = {
    "qwen3-coder.jinja": ("qwen3_coder", True),
    "glm-4.5.jinja": ("glm45", True),
    "llama-3.1.jinja": ("llama3", True),
    "mistral-small-3.1.jinja": ("mistral", True),
    "mistral-v11.jinja": ("mistral_v11", True),
    "deepseek-r1-distill-qwen.jinja": ("deepseek_r1", False),
    "deepseek-v3.1.jinja": ("deepseek_v31", False),
}
ENDS = ("<|im_end|>", "<|eot_id|>", "<｜end▁of▁sentence｜>", "</s>", "<|assistant|>", "<|user|>")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_is_detected_from_its_template(name):
    template = chat.ChatTemplate((TEMPLATES / name).read_text(), eos_token="</s>")
    fmt, shows_tools = FAMILIES[name]
    assert tools.format_for(template) == fmt
    assert tools.native(template) == shows_tools
    assert tools.format_for(template, "hermes") == "hermes"  # [target] tool_format overrides


def test_a_template_without_calls_is_edgespecs_format():
    assert tools.format_for(chat.ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")) == "hermes"
    assert tools.format_for(None) == "hermes"
    assert tool_formats.detect("{{ '<tool_call>' }}{{ tools }}") == "hermes"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_call_the_template_renders_parses_back_whole_and_a_character_at_a_time(name):
    fmt, _ = FAMILIES[name]
    f = tool_formats.by_name(fmt)
    template = chat.ChatTemplate((TEMPLATES / name).read_text(), eos_token="</s>")
    want = calls_of(fmt)
    calls = [{"id": f"call_{i:09d}", "type": "function",
              "function": {"name": n, "arguments": json.dumps(a) if f.text_arguments else a}}
             for i, (n, a) in enumerate(want)]
    rendered = template.render([{"role": "user", "content": "Weather?"},
                                {"role": "assistant", "content": None if f.text_arguments else "", "tool_calls": calls}],
                               [WEATHER, ADD])
    after = rendered[rendered.rindex("Weather?") + len("Weather?"):]
    start = min(after.find(o) for o in f.openers if o in after)
    text = after[start:]
    text = text[:min([text.find(e) for e in ENDS if e in text] or [len(text)])].rstrip()
    s = spec(fmt)
    content, got = s.parse(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in got] == want
    content, parts, calls = streamed(s, list(text))
    assert content == ""
    assert [(n, json.loads(a)) for n, a in parts.values()] == want
    assert [c.arguments for c in calls] == [a for _, a in parts.values()]


def test_qwen3s_template_writes_hermes_calls_that_parse_back():
    """Qwen3 (and Qwen2.5) write edgespec's own Hermes format: detected, rendered, parsed back whole
    and a character at a time."""
    template = chat.ChatTemplate((TEMPLATES / "qwen3.jinja").read_text(), eos_token="<|im_end|>")
    assert tools.format_for(template) == "hermes" and tools.native(template)
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
             for i, (n, a) in enumerate(CALLS)]
    rendered = template.render([{"role": "user", "content": "Weather?"},
                                {"role": "assistant", "content": "", "tool_calls": calls}], [WEATHER, ADD])
    text = rendered[rendered.index("<tool_call>", rendered.rindex("Weather?")):rendered.rindex("<|im_end|>")]
    s = spec("hermes")
    content, got = s.parse(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in got] == CALLS
    assert [(n, json.loads(a)) for n, a in streamed(s, list(text))[1].values()] == CALLS


# ---- the parsers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seed", [0, 1])
def test_every_parser_streams_calls_in_pieces_whatever_the_split(fmt, seed):
    s = spec(fmt)
    text = tool_formats.by_name(fmt).render(calls_of(fmt))
    rng = np.random.default_rng(seed)
    cuts = sorted(set(rng.integers(1, len(text), size=len(text) // 3).tolist())) if seed else list(range(1, len(text)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, parts, calls = streamed(s, pieces)
    assert content == ""
    assert [(n, json.loads(a)) for n, a in parts.values()] == calls_of(fmt)
    assert [(c.name, c.arguments) for c in calls] == [tuple(p) for p in parts.values()]
    assert [c.id for c in calls] == [c.id for c in calls] and len({c.id for c in calls}) == len(calls)
    whole = s.parse(text)[1]
    assert [(c.name, c.arguments) for c in whole] == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("fmt", FORMATS)
def test_text_and_calls_cut_short(fmt):
    s = spec(fmt)
    f = tool_formats.by_name(fmt)
    text = f.render(calls_of(fmt))
    assert s.parse("It is sunny in Oslo.") == ("It is sunny in Oslo.", ())
    assert streamed(s, list("It is sunny."))[0] == "It is sunny."
    half = text[:len(text) // 2]
    assert s.parse(half) == (half, ())  # cut short, not by max_tokens: text
    if f.parallel:  # max_tokens cut the second call: the first is kept
        cut = f.render(CALLS)
        two = cut[:cut.rindex("add") + 5]  # into the second call
        content, got = s.parse(two, truncated=True)
        assert content is None and [c.name for c in got] == ["get_weather"]


def test_each_format_reads_its_familys_other_spellings():
    """What the families write beside the grammar's spelling: Llama's <|python_tag|>, Mistral's
    v11 [TOOL_CALLS]NAME[ARGS]{...}, GLM's template without newlines, a Qwen3-Coder boolean
    as Python prints it."""
    cases = {
        "llama3": '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}',
        "mistral": '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
        "glm45": "<tool_call>add<arg_key>a</arg_key>\n<arg_value>1</arg_value><arg_key>b</arg_key>"
                 "\n<arg_value>2</arg_value></tool_call>",
        "qwen3_coder": "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
                       "</function>\n</tool_call>",
        "deepseek_r1": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": 1, "b": 2}\n```'
                       "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    }
    for fmt, text in cases.items():
        content, got = spec(fmt).parse(text)
        assert content is None and [(c.name, json.loads(c.arguments)) for c in got] == [("add", {"a": 1, "b": 2})], fmt
        assert [(n, json.loads(a)) for n, a in streamed(spec(fmt), list(text))[1].values()] == [("add", {"a": 1, "b": 2})]
    got = spec("qwen3_coder").parse(tool_formats.by_name("qwen3_coder").render([("get_weather", {
        "city": "x", "unit": "f", "metric": False})]))[1]
    assert json.loads(got[0].arguments) == {"city": "x", "unit": "f", "metric": False}


# ---- the grammar -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_grammar_lets_valid_calls_through_and_refuses_the_rest(compiler, fmt):
    f = tool_formats.by_name(fmt)
    auto, required, named, none = spec(fmt), spec(fmt, "required"), \
        spec(fmt, {"type": "function", "function": {"name": "add"}}), spec(fmt, "none")
    good = f.render(calls_of(fmt))
    add = f.render([("add", {"a": 1, "b": 2})])
    assert accepts(compiler, auto, good) and accepts(compiler, required, good)
    assert accepts(compiler, auto, "Just text.") and not accepts(compiler, required, "Just text.")
    assert accepts(compiler, none, "Just text.") and not accepts(compiler, none, add)
    assert accepts(compiler, named, add) and not accepts(compiler, named, f.render([CALLS[0]]))
    for bad in ({"city": "x" * 41, "unit": "c"}, {"city": "Oslo", "unit": "k"}, {"unit": "c"}, {"city": "Oslo", "unit": "c", "days": "three"},
                {"city": "Oslo", "unit": "c", "days": 0}, {"city": "Oslo", "unit": "c", "wind": 3}):
        assert not accepts(compiler, auto, f.render([("get_weather", bad)])), (fmt, bad)
    assert not accepts(compiler, auto, f.render([("nope", {})]))
    if f.parallel:
        assert not accepts(compiler, spec(fmt, parallel=False), good)


BOOK_PARAMS = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "note": {"type": "string", "pattern": "ok"},
    "day": {"type": "string", "format": "date"}, "mode": {"type": "string", "enum": ["fast", "slow"]},
    "who": {"type": "string", "format": "email", "maxLength": 12}},
    "required": ["code", "note", "day", "mode"]}
BOOK = {"type": "function", "function": {"name": "book", "parameters": BOOK_PARAMS}}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_string_parameters_pattern_format_and_enum_hold_in_every_format(compiler, fmt):
    """The XML families write strings raw, outside llguidance's JSON: their grammar holds a
    pattern (anchored or not, as JSON Schema reads it), a format and an enum itself."""
    f = tool_formats.by_name(fmt)
    s = tools.parse_tools([BOOK], "required", None, fmt)
    good = {"code": "ABC-12", "note": "it is ok now", "day": "2026-12-06", "mode": "fast", "who": "a@b.io"}
    assert accepts(compiler, s, f.render([("book", good)]))
    assert accepts(compiler, s, f.render([("book", {k: v for k, v in good.items() if k != "who"})]))
    for key, bad in (("code", "ABC-123"), ("code", "xABC-12"), ("note", "nope"), ("day", "2026-13-06"),
                     ("day", "6 Dec"), ("mode", "medium"), ("who", "not an email"), ("who", "a@very.long.io")):
        assert not accepts(compiler, s, f.render([("book", {**good, key: bad})])), (fmt, key, bad)


@pytest.mark.parametrize("fmt", ["qwen3_coder", "glm45"])
def test_a_pattern_or_format_the_grammar_cannot_hold_is_refused_naming_the_field(fmt):
    for prop, field in (({"type": "string", "format": "iri-reference"}, "format"),
                        ({"type": "string", "pattern": "^(?!x)"}, "pattern"),
                        ({"type": "string", "pattern": "(a)\\1"}, "pattern")):
        params = {"type": "object", "properties": {"n": {"type": "integer"}, "s": prop}}
        with pytest.raises(BadRequest) as e:
            tools.parse_tools([ADD, {"type": "function", "function": {"name": "f", "parameters": params}}],
                              None, None, fmt)
        assert e.value.field == f"tools[1].function.parameters.properties.s.{field}"
    # the JSON families leave a format to llguidance's JSON schema support
    assert tools.parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "format": "iri-reference"}}}}}], None, None, "llama3")


CLOSERS = '"}]\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n</parameter>\n</function>\n</tool_call></arg_value>\n</tool_call>0'


def walk(compiler: Compiler, s: tools.ToolSpec, prefer: str, rng: np.random.Generator, p_other: float) -> str:
    """A walk under the grammar's mask by a 'model' that would write `prefer` (broken arguments):
    its next character where the mask allows it (else that character is skipped), with
    probability p_other any allowed printable character instead; then end-of-generation as soon
    as it is allowed, meanwhile the characters that close a call (CLOSERS, over and over, each
    skipped where the mask refuses it)."""
    m = compiler.matcher(s.constraint())
    want, out, i = _tokenize(prefer), list[int](), 0
    closers, k = _tokenize(CLOSERS), 0
    for _ in range(4000):
        mask = m.mask()
        if mask[EOS] and i >= len(want):
            return bytes(out).decode()
        while i < len(want) and not mask[want[i]]:
            i += 1
        printable = [t for t in range(32, 127) if mask[t]]
        if i < len(want) and (rng.random() >= p_other or not printable):
            tok = want[i]
            i += 1
        elif i < len(want):
            tok = int(rng.choice(printable))
        else:
            ok = [j for j in range(len(closers)) if mask[closers[(k + j) % len(closers)]]]
            tok = closers[(k + ok[0]) % len(closers)] if ok else int(np.flatnonzero(mask[:EOS])[0])
            k += ok[0] + 1 if ok else 0
        m.commit([tok])
        out.append(tok)
    raise AssertionError(f"no end after 4000 tokens: {bytes(out)[:300]!r}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_calls_forced_by_the_grammar_parse_and_validate_greedy_and_sampled(compiler, fmt):
    f = tool_formats.by_name(fmt)
    broken = f.render([("get_weather", {"city": "Oslo", "unit": "kelvin", "days": "three", "extra": 1}),
                       ("add", {"a": "2", "b": None})][:2 if f.parallel else 1])
    for s in (spec(fmt, "required"), spec(fmt)):
        for seed, p_other in ((0, 0.0), (1, 0.05), (2, 0.05)):
            text = walk(compiler, s, broken, np.random.default_rng(seed), p_other)
            content, calls = s.parse(text)
            if s.choice == "auto" and not any(text.startswith(o) for o in f.openers):
                assert content == text  # auto: it wandered off the call's opening, into text
                continue
            assert content is None and calls, (fmt, seed, text)
            for c in calls:
                jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
            _, parts, streamed_calls = streamed(s, list(text))
            assert [(c.name, c.arguments) for c in streamed_calls] == [tuple(p) for p in parts.values()]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_long_argument_streams_in_pieces_in_linear_time(fmt, monkeypatch):
    """A 10 KB argument fed 4 characters at a time: scanned about 16 * log(n) times, not n / 4,
    and still sent in pieces that concatenate to the whole (the XML formats send a value whole,
    once its closing tag is read)."""
    f = tool_formats.by_name(fmt)
    text = f.render([("get_weather", {"city": "x" * 30, "unit": "c", "where": {"lat": 1.5, "notes": "y" * 10_000}})])
    scans = []
    real = f.scan
    monkeypatch.setattr(f, "scan", lambda t, tools_: scans.append(len(t)) or real(t, tools_))
    s = tools.parse_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}], None, None, fmt)
    st = s.stream()
    events = [ev for i in range(0, len(text), 4) for ev in st.feed(text[i:i + 4])] + st.finish()
    fragments = [v.arguments for k, v in events if k == "call" and v.id is None]
    assert len(fragments) > (3 if isinstance(f, tool_formats._Xml) else 10) and json.loads("".join(fragments)) == json.loads(st.calls[0].arguments)
    assert len(scans) < 200
