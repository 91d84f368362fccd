"""Reasoning output (edgespec.reasoning): the <think> block split from the content whole and a
character at a time (opened by the model, or by the prompt), the family detected from the real
templates, the grammar that holds the answer to a schema or a tool grammar only after </think>,
and speculation exact through the switch: tree-mode sampling at T = 1 on the fake engine under
that grammar matches the target's masked distribution (chi-square, as
tests/test_constrained_sampling.py does for a bare schema)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgespec import budget, chat, reasoning, tool_formats, tools
from edgespec.constraint import Compiler, Vocabulary, apply_mask
from edgespec.sampling import SamplingParams, logits_to_probs
from edgespec.selftest import ALPHA, chi_square_gof
from edgespec.types import ConstraintSpec, GenerationRequest, ReasoningBudget, SpeculationParams
from tests import fake_backend
from tests.fake_backend import EOS, VOCAB

TEMPLATES = Path(__file__).parent / "templates"


def split_streamed(opened: bool, pieces: list[str]) -> tuple[str, str]:
    s = reasoning.ReasoningSplitter(opened)
    events = [ev for p in pieces for ev in s.feed(p)] + s.finish()
    assert all(v for _, v in events)  # nothing empty is sent
    return "".join(v for k, v in events if k == "reasoning"), "".join(v for k, v in events if k == "content")


CASES = [  # (opened, answer, reasoning, content)
    (False, "<think>\nLet me see.\n</think>\n\nIt is 3.", "\nLet me see.\n", "It is 3."),
    (True, "Let me see: 1 < 2 </thin but not closed.\n</think>\n\nIt is 3.", "Let me see: 1 < 2 </thin but not closed.\n",
     "It is 3."),
    (False, "It is 3.", None, "It is 3."),
    (False, "<thin is not a tag", None, "<thin is not a tag"),
    (False, "<think>cut short by max_tokens", "cut short by max_tokens", ""),
    (True, "</think>It is 3.", "", "It is 3."),
]


@pytest.mark.parametrize("opened, answer, want_reasoning, want_content", CASES)
def test_the_block_is_split_whole_and_in_any_pieces(opened, answer, want_reasoning, want_content):
    r = reasoning.Reasoning(opened)
    assert r.split(answer) == (want_reasoning, want_content)
    for cuts in (list(range(1, len(answer))), [3, 9, 17]):
        pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])]
        assert split_streamed(opened, pieces) == (want_reasoning or "", want_content)


@pytest.mark.parametrize("name, fmt", [("deepseek-r1-distill-qwen.jinja", "think"), ("deepseek-v3.1.jinja", "think"),
                                       ("glm-4.5.jinja", "think"), ("qwen3.jinja", "think"),
                                       ("llama-3.1.jinja", "none")])
def test_the_format_and_the_open_block_come_from_the_template(name, fmt):
    template = chat.ChatTemplate((TEMPLATES / name).read_text())
    assert reasoning.format_for(template) == fmt
    assert reasoning.format_for(template, "none") == "none"
    if name.startswith("deepseek-r1"):  # R1 opens the block in the generation prompt
        assert reasoning.opened(template.render([{"role": "user", "content": "hi"}]))
    if name.startswith("glm"):  # GLM writes <think> itself, and closes it empty when asked not to think
        assert not reasoning.opened(template.render([{"role": "user", "content": "hi"}]))
        assert template.render([{"role": "user", "content": "hi"}], variables={"enable_thinking": False}) \
            .endswith("<think></think>")
    if name.startswith("qwen3"):  # Qwen3 writes <think> itself; asked not to think, an empty block closes
        assert not reasoning.opened(template.render([{"role": "user", "content": "hi"}]))
        assert template.render([{"role": "user", "content": "hi"}], variables={"enable_thinking": False}) \
            .endswith("<think>\n\n</think>\n\n")
    if name.startswith("deepseek-v3.1"):  # V3.1 thinks only when asked to
        assert reasoning.opened(template.render([{"role": "user", "content": "hi"}],
                                                variables={"enable_thinking": True}))
        assert not reasoning.opened(template.render([{"role": "user", "content": "hi"}]))


@pytest.mark.parametrize("name", ["qwen3.jinja", "glm-4.5.jinja"])
def test_earlier_reasoning_is_shown_after_the_last_user_turn_and_dropped_before(name):
    """An assistant turn's reasoning_content (tools.template_inputs passes it through): Qwen3's and
    GLM's templates show it in the turns after the last user query (a tool round trip) only."""
    template = chat.ChatTemplate((TEMPLATES / name).read_text())
    call = tools.ToolCall("call_1", "add", '{"a": 1}')
    msgs = (("user", "1+1?"), ("assistant", ""), ("tool", "2"))
    extras = ({}, {"tool_calls": (call,), "reasoning_content": "Add them."}, {"tool_call_id": "call_1"})
    spec = tools.parse_tools([ADD], None, None, tools.format_for(template))
    m, ex, t = tools.template_inputs(msgs, extras, spec, template)
    assert "Add them." in template.render([{"role": r, "content": c, **e} for (r, c), e in zip(m, ex)], t)
    msgs += (("assistant", "It is 2."), ("user", "And 2+2?"))
    extras += ({}, {})
    m, ex, t = tools.template_inputs(msgs, extras, spec, template)
    assert "Add them." not in template.render([{"role": r, "content": c, **e} for (r, c), e in zip(m, ex)], t)


# ---- the grammar after the reasoning ----------------------------------------------------------

BYTES = tuple(bytes([i]) for i in range(256)) + (b"\xff<eos>",)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


@pytest.fixture(scope="module")
def compiler() -> Compiler:
    return Compiler(Vocabulary(BYTES, (256,), (256,), None, lambda s: list(s.encode())))


def accepts(compiler: Compiler, spec: ConstraintSpec, text: str) -> bool:
    m = budget.matcher(compiler, spec)
    toks = list(text.encode())
    if not m.allows(toks):
        return False
    m.commit(toks)
    return m.accepting


def test_a_schema_holds_only_after_the_reasoning(compiler):
    inner = ConstraintSpec("json_schema", json.dumps(SCHEMA))
    free = reasoning.after_reasoning(inner, opened=False)
    inside = reasoning.after_reasoning(inner, opened=True)
    assert accepts(compiler, free, '<think>{"a": "no"} is wrong; </thin\n</think>\n\n{"a":1}')
    assert accepts(compiler, free, '{"a":1}')  # no reasoning at all
    assert not accepts(compiler, free, '<think>x</think>\n{"a":"x"}')
    assert not accepts(compiler, free, "<think>x</think>\nhello")
    assert accepts(compiler, inside, 'x</think>{"a":1}') and not accepts(compiler, inside, '{"a":1}')
    assert not accepts(compiler, inside, 'x</think>{"a":1}</think>')
    regex = reasoning.after_reasoning(ConstraintSpec("regex", "[0-9]+/[0-9]+"), opened=True)
    assert accepts(compiler, regex, "hmm</think>12/34") and not accepts(compiler, regex, "hmm</think>x")
    gbnf = ConstraintSpec("grammar", 'root ::= "x"')
    assert reasoning.after_reasoning(gbnf, opened=True) == gbnf  # GBNF cannot be composed


@pytest.mark.parametrize("fmt", tool_formats.FORMATS)
def test_a_tool_grammar_holds_only_after_the_reasoning(compiler, fmt):
    s = tools.parse_tools([ADD], None, None, fmt)
    f = tool_formats.by_name(fmt)
    call = f.render([("add", {"a": 1})]) if f else '<tool_call>\n{"name":"add","arguments":{"a":1}}\n</tool_call>'
    bad = call.replace("1", '"x"')
    g = reasoning.after_reasoning(s.constraint(not_text=(reasoning.OPEN,)), opened=False)
    assert accepts(compiler, g, f"<think>I will call add.</think>\n\n{call}")
    assert accepts(compiler, g, "<think>No tool.</think>\n\nHello") and accepts(compiler, g, "Hello")
    assert not accepts(compiler, g, f"<think>x</think>\n\n{bad}")  # nor as text: text may not open a call


# ---- exact through the switch -------------------------------------------------------------------

PIECES = ["</think>", "{", "}", '"', ":", ",", '{"', '":', '"}', " ", "\n", "</", "think", ">"]
PIECES += list("0123456789") + list("abcdefghijklmnopqrstuvwxyz") + ["ab", "ba", "12", "42", "th", "in", "nk", "<", "cd",
           "dc", "xy", "yx"]
PIECES = PIECES[:VOCAB - 2]
STRING_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}, "required": ["a"],
                 "additionalProperties": False}
SPEC = reasoning.after_reasoning(ConstraintSpec("json_schema", json.dumps(STRING_SCHEMA)), opened=True)
L, TOP_K, SAMPLES = 6, 3, 2000
PROMPT = (0, 7, 21)


PieceModel = fake_backend.piece_model(PIECES)

@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setattr(fake_backend, "FakeModel", PieceModel)
    eng = fake_backend.fake_backed_engine(parallel=8, draft_noise=1.5)
    eng.target.table[:, 2] += 4.0  # </think> likely, so that the first L tokens cross the switch often
    return eng


def exact(engine, spec: ConstraintSpec = SPEC) -> dict:
    """P(first L emitted tokens): the target's rows masked by the grammar's state after each path."""
    m = budget.matcher(Compiler(Vocabulary.from_model(engine.target)), spec)
    s = SamplingParams(temperature=1.0, top_k=TOP_K)
    out: dict = {}

    def walk(path: list[int], last: int, prob: float) -> None:
        if len(path) == L:
            out[tuple(path)] = out.get(tuple(path), 0.0) + prob
            return
        p = logits_to_probs(apply_mask(engine.target.table[last], m.mask_after(path)), s)
        for x in np.flatnonzero(p):
            if x == EOS:
                out[tuple(path)] = out.get(tuple(path), 0.0) + prob * p[x]
            else:
                walk(path + [int(x)], int(x), prob * p[x])

    walk([], PROMPT[-1], 1.0)
    return out


def sample(engine, n: int, spec: ConstraintSpec = SPEC) -> dict:
    counts: dict = {}
    todo, active = list(range(n)), list[Any]()
    while todo or active:
        while todo and engine.free_slots:
            seed = todo.pop()
            req = GenerationRequest(PROMPT, SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=L, seed=seed),
                                    SpeculationParams(mode="tree", tree_depth=3, tree_nodes=6), constraint=spec)
            active.append(engine.open_session(req))
        engine.tick(active)
        for s in list(active):
            if s.done:
                k = tuple(s.out[:L])
                counts[k] = counts.get(k, 0) + 1
                s.close()
                active.remove(s)
    return counts


def test_tree_sampling_through_the_switch_matches_the_masked_target(engine):
    e = exact(engine)
    assert abs(sum(e.values()) - 1) < 1e-9
    switched = sum(p for k, p in e.items() if 2 in k)
    assert 0.3 < switched < 1  # most paths cross </think> within L tokens, some do not
    counts = sample(engine, SAMPLES)
    texts = [engine.target.detokenize(list(k)) for k in counts]
    after = [t.split("</think>", 1)[1].lstrip()[:6] for t in texts if "</think>" in t]
    assert after and all('{"a":"'.startswith(a) for a in after), after  # the schema held after the switch
    keys = sorted(set(e) | set(counts))
    p = chi_square_gof(np.array([counts.get(k, 0) for k in keys]), np.array([e.get(k, 0.0) for k in keys]))[2]
    assert p > ALPHA, counts


def test_rows_masked_as_before_the_switch_are_rejected(engine, monkeypatch):
    """A broken twin: the row after a </think> token masked with the reasoning's state (free
    text: the switch one token late). A token the schema forbids reaches the grammar's commit."""
    from edgespec import constraint

    real = constraint.Matcher.node_bits

    def late(self, tree):
        nm = real(self, tree)
        idx = [max(0, p) if t == 2 and i else i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents))]
        return constraint.NodeMasks(nm.bits[idx], nm.valid[idx], nm.n_vocab)

    monkeypatch.setattr(constraint.Matcher, "node_bits", late)
    with pytest.raises(RuntimeError, match="not allowed"):
        sample(engine, 400)


# ---- the reasoning budget -----------------------------------------------------------------------

BUDGET = dataclasses.replace(SPEC, budget=ReasoningBudget(2, close="</think>", opened=True))


def test_the_budget_closes_the_block_and_tree_sampling_stays_exact(engine):
    """Two tokens of reasoning at most, then </think> forced, then the schema: the tree's samples
    follow the masked target through the forced close."""
    e = exact(engine, BUDGET)
    assert abs(sum(e.values()) - 1) < 1e-9
    for k in e:
        if len(k) > 2 and 2 not in k[:2]:
            assert k[2] == 2, k  # the budget spent: </think> next
    assert sum(p for k, p in e.items() if 2 not in k[:2]) > 0.3  # the close is forced often
    counts = sample(engine, SAMPLES, BUDGET)
    keys = sorted(set(e) | set(counts))
    p = chi_square_gof(np.array([counts.get(k, 0) for k in keys]), np.array([e.get(k, 0.0) for k in keys]))[2]
    assert p > ALPHA, counts


def test_verifying_without_the_budgets_mask_is_rejected(engine, monkeypatch):
    """A broken twin: the tree's rows masked by the grammar alone (the budget only in drafting):
    a token other than the forced close reaches the budget's commit."""
    from edgespec import budget

    monkeypatch.setattr(budget.BudgetMatcher, "node_bits", lambda self, tree: self.inner.node_bits(tree))
    with pytest.raises(RuntimeError, match="reasoning budget"):
        sample(engine, 400, BUDGET)


def test_the_budget_opens_with_the_answers_own_think_and_ends_at_its_close():
    from edgespec.budget import BudgetMatcher, State

    toks = [b"<think>", b"a", b"b", b"</think>", b"x", b" ", b"<", b"think>"]
    m = BudgetMatcher.__new__(BudgetMatcher)
    m.budget, m._bytes, m.close = ReasoningBudget(3), toks, [3]
    st = State("start")
    assert m.step(st, 5) == State("start", seen=b"")  # leading whitespace: the block may still open
    st = m.step(m.step(State("start"), 6), 7)
    assert st is not None and st.phase == "think" and st.count == 1
    st = m.step(m.step(st, 1), 2)
    assert st == State("close") and m.forced_token(st) == 3 and m.step(st, 1) is None
    assert m.step(st, 3) == State("free")
    assert m.step(m.step(m.step(State("start"), 0), 1), 3) == State("free")  # closed by the model in budget
    assert m.step(State("start"), 4) == State("free")  # no block: no budget
