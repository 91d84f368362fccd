"""Markers that are control tokens (a model whose `<think>` or `<tool_call>` is one token): found
by id in a real llama.cpp vocabulary, rendered as their text, so that the reasoning split, the
call parsers and the grammar see them."""

from __future__ import annotations

import json

import pytest

from edgespec import reasoning, tools
from edgespec.constraint import Compiler, Vocabulary
from edgespec.emit import Emitter
from edgespec.types import ConstraintSpec
from tests.tiny_gguf import write_tiny

CONTROLS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|other|>")
THINK, UNTHINK, CALL, UNCALL, OTHER = range(258, 258 + len(CONTROLS))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from edgespec.backend import Model

    m = Model(write_tiny(tmp_path_factory.mktemp("markers") / "controls.gguf", controls=CONTROLS))
    yield m
    m.close()


def ids(model, *parts) -> list[int]:
    """Token ids: ints as they are, text tokenised (bytes)."""
    out: list[int] = []
    for p in parts:
        out += [p] if isinstance(p, int) else model.tokenize(p, add_special=False)
    return out


def text_of(model, tokens, piece=None) -> str:
    """The answer's text as the engine emits it (edgespec.emit)."""
    e = Emitter(len(tokens), (), model.is_eog, piece or model.piece)
    return e.push(tokens)[1]


def test_the_markers_among_the_control_tokens_are_found_by_id(model):
    assert {t: model.special_tokens[s] for s, t in zip(CONTROLS, range(258, 263))} == {t: t for t in range(258, 263)}
    assert model.kept_markers == {THINK: b"<think>", UNTHINK: b"</think>", CALL: b"<tool_call>", UNCALL: b"</tool_call>"}
    assert model.piece(THINK) == b"<think>" and model.piece(OTHER) == b"" and model.piece(257) == b""


def test_a_think_block_of_control_tokens_splits(model):
    answer = ids(model, THINK, "plan it", UNTHINK, "\n\nDone.")
    assert reasoning.Reasoning().split(text_of(model, answer)) == ("plan it", "Done.")
    # a broken twin: the control tokens rendered empty, as llama.cpp's piece does: nothing splits
    blank = lambda t: b"" if t >= 256 else model.piece(t)
    assert reasoning.Reasoning().split(text_of(model, answer, blank)) == (None, "plan it\n\nDone.")
    # streamed a token at a time, the split is the same
    s = reasoning.ReasoningSplitter()
    e = Emitter(len(answer), (), model.is_eog, model.piece)
    events = [ev for t in answer for ev in s.feed(e.push([t])[1])] + s.finish()
    assert "".join(v for k, v in events if k == "reasoning") == "plan it"
    assert "".join(v for k, v in events if k == "content") == "Done."


def test_a_call_in_control_tokens_parses(model):
    spec = tools.parse_tools([{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}], None, None)
    answer = ids(model, CALL, '\n{"name":"add","arguments":{"a":1}}\n', UNCALL)
    content, calls = spec.parse(text_of(model, answer))
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1})]


def test_the_grammar_allows_the_control_token_and_the_spelled_marker(model):
    """A grammar's `<think>` and `</think>` match the one control token as well as the text spelled
    in byte tokens; the other control tokens stay out of reach of grammar text."""
    compiler = Compiler(Vocabulary.from_model(model))
    spec = reasoning.after_reasoning(ConstraintSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})), opened=False)

    def accepts(tokens: list[int]) -> bool:
        m = compiler.matcher(spec)
        return m.allows(tokens) and (m.commit(tokens) or m.accepting)

    assert accepts(ids(model, THINK, "hm", UNTHINK, '{"a":1}'))
    assert accepts(ids(model, "<think>hm</think>", '{"a":1}'))
    assert accepts(ids(model, THINK, "hm</think>", '{"a":1}'))
    assert not accepts(ids(model, THINK, "hm", UNTHINK, '{"a":"x"}'))
    assert not accepts(ids(model, OTHER, '{"a":1}'))
