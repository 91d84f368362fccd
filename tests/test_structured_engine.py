"""Structured output through the engine's tick on the demo pair: a JSON schema constrains every
mode; greedy constrained output is the same in plain, chain, tree and auto, parses and validates;
several constrained and unconstrained requests batch together."""

from __future__ import annotations

import json

import jsonschema
import pytest

from edgespec.sampling import SamplingParams
from edgespec.types import ConstraintSpec, GenerationRequest, SpeculationParams

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "year": {"type": "integer", "minimum": 0, "maximum": 3000}},
          "required": ["name", "year"], "additionalProperties": False}
PROMPTS = ['Extract as JSON: "Alice Smith joined Initech in 2021."',
           "Return the name and founding year of the company that makes the iPhone as JSON."]


def request(engine, prompt, mode, constrained=True):
    toks = engine.encode_chat([("user", prompt)])
    c = ConstraintSpec("json_schema", json.dumps(SCHEMA)) if constrained else None
    return GenerationRequest(tuple(toks), SamplingParams(max_tokens=80), SpeculationParams(mode=mode), constraint=c)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_constrained_greedy_is_the_same_in_every_mode_and_validates(engine, prompt):
    out = {m: engine.generate(request(engine, prompt, m)) for m in ("plain", "chain", "tree", "auto")}
    ref = out["plain"]
    assert ref.finish_reason == "eos"
    jsonschema.validate(json.loads(ref.text), SCHEMA)
    for m, r in out.items():
        assert r.token_ids == ref.token_ids, m
    assert out["chain"].stats.accepted_tokens > 0


def test_constrained_and_free_requests_batch_together(engine):
    sess = [engine.open_session(request(engine, PROMPTS[0], "tree")),
            engine.open_session(request(engine, PROMPTS[1], "auto", constrained=False))]
    while any(not s.done for s in sess):
        engine.tick([s for s in sess if not s.done])
    texts = [s.text for s in sess]
    outs = [list(s.out) for s in sess]
    for s in sess:
        s.close()
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    free = engine.generate(request(engine, PROMPTS[1], "plain", constrained=False))
    assert outs[1] == free.token_ids


def test_the_tokens_the_grammar_forces_ride_along_as_free_drafts(engine):
    """`{"` and the first key are the only tokens the schema allows at the start: an auto request
    gets them grafted under its first root (no draft forward) and emits them with the first token,
    where plain mode (the reference) decodes them one forward each."""
    first = {}
    for mode in ("plain", "auto"):
        sess = engine.open_session(request(engine, PROMPTS[0], mode))
        try:
            while sess.prefilling:
                engine.tick([sess])
            chunk = engine.tick([sess])[sess]
            first[mode] = (len(chunk.token_ids), dict(sess.stats.steps_per_mode), sess.stats.draft_forwards)
        finally:
            sess.close()
    assert first["plain"][0] == 1
    n, kinds, draft_forwards = first["auto"]
    assert n >= 3 and draft_forwards == 0  # `{"`, `name`, then the target's own `":"`
    assert set(kinds) <= {"forced", "ngram"}


def test_a_constraint_compiled_on_another_thread_decodes_the_same(engine, monkeypatch):
    """Engine.compile_constraint in a handler's thread (the daemon's way), handed over as
    GenerationRequest.matcher: the engine thread compiles nothing, and the output is the one it
    gets compiling the constraint itself."""
    import dataclasses
    import threading

    req = request(engine, PROMPTS[0], "chain")
    want = engine.generate(req)
    box = []
    worker = threading.Thread(target=lambda: box.append(engine.compile_constraint(req.constraint)))
    worker.start()
    worker.join(60)

    def refuse(spec):
        raise AssertionError("compiled on the engine thread")

    monkeypatch.setattr(engine, "constraint_matcher", refuse)
    got = engine.generate(dataclasses.replace(req, matcher=box[0]))
    assert got.token_ids == want.token_ids and got.finish_reason == "eos"


def test_a_reasoning_budget_closes_the_block_on_the_real_model_in_every_mode(engine):
    """The demo model is no thinking model, so its answer, taken as a block the prompt opened,
    runs until max_tokens unless the budget closes it: with a budget of 6 the first 6 tokens
    are plain greedy's, then the close is forced (whatever its tokenization under the real
    vocabulary), then the answer goes on, the same in every mode."""
    from edgespec.reasoning import Reasoning

    toks = tuple(engine.encode_chat([("user", PROMPTS[1])]))
    free = engine.generate(GenerationRequest(toks, SamplingParams(max_tokens=6), SpeculationParams(mode="plain")))
    spec = Reasoning(opened=True, budget=6).constraint(None)
    out = {m: engine.generate(GenerationRequest(toks, SamplingParams(max_tokens=24), SpeculationParams(mode=m),
                                                constraint=spec)) for m in ("plain", "chain", "tree", "auto")}
    ref = out["plain"]
    assert ref.token_ids[:6] == free.token_ids and "</think>" not in free.text
    assert ref.text.startswith(free.text + "\n</think>\n\n")
    thought, content = Reasoning(opened=True).split(ref.text)
    assert thought == free.text + "\n" and content
    for m, r in out.items():
        assert r.token_ids == ref.token_ids, m
