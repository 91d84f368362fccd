"""Constrained sampling through the engine at T = 1 (fake backend, fast): a JSON schema, the
emitted tokens distributed as the target's rows masked by the grammar and renormalised.

The fake target is the bigram table of tests/fake_backend.py over a vocabulary of JSON pieces
(`{`, `{"`, `":`, digits, letters, ...), so the grammar's masks are real llguidance masks and
several tokenizations of one text compete. Requests in tree mode: the drafter draws its children
from the draft's distribution masked at each node's state and the tree carries that masked q
(the session verifies with `q_masked=False`); the grammar's forced tokens are grafted as point
drafts. The exact distribution of the first L = 6 emitted tokens (top_k 3 after the mask:
the forced `{"a":` and then the string) is enumerated with the grammar's own masks; Pearson chi-square at alpha 1e-3.

Broken twins that must be rejected: a drafter that draws from the masked q but reports the
unmasked one (statistically); rows masked by the parent's grammar state instead of the node's
own (loudly: a forbidden token reaches the grammar's commit)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from edgespec.constraint import Compiler, Vocabulary, apply_mask
from edgespec.sampling import SamplingParams, logits_to_probs
from edgespec.selftest import ALPHA, chi_square_gof
from edgespec.types import ConstraintSpec, GenerationRequest, SpeculationParams
from tests import fake_backend
from tests.fake_backend import EOS, VOCAB

pytest.importorskip("llguidance")

PIECES = ['{', '}', '"', ':', ',', '{"', '":', '"}', '-', ' '] + list("0123456789") + list("abcdefghijklmnopqrstuvwxyz")
PIECES += ["ab", "ba", "12", "42", "ca", "de", "ed", "fa", "af", "be", "eb", "cd", "dc", "xy", "yx", "zz"]
PIECES = PIECES[:VOCAB - 2]
SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}, "required": ["a"],
          "additionalProperties": False}
SPEC = ConstraintSpec("json_schema", json.dumps(SCHEMA))
L = 6
TOP_K = 3
SAMPLES = 3000
PROMPT = (0, 7, 21)


JsonModel = fake_backend.piece_model(PIECES)

@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setattr(fake_backend, "FakeModel", JsonModel)
    eng = fake_backend.fake_backed_engine(parallel=8, draft_noise=1.5)
    assert isinstance(eng.target, JsonModel)
    return eng


def exact(engine) -> dict:
    """P(first L emitted tokens), from the target's rows masked by the grammar, renormalised."""
    m = Compiler(Vocabulary.from_model(engine.target)).matcher(SPEC)
    s = SamplingParams(temperature=1.0, top_k=TOP_K)
    table = engine.target.table
    out: dict = {}

    def walk(path: list[int], last: int, prob: float) -> None:
        if len(path) == L:
            out[tuple(path)] = out.get(tuple(path), 0.0) + prob
            return
        p = logits_to_probs(apply_mask(table[last], m.mask_after(path)), s)
        for x in np.flatnonzero(p):
            if x == EOS:
                out[tuple(path)] = out.get(tuple(path), 0.0) + prob * p[x]
            else:
                walk(path + [int(x)], int(x), prob * p[x])

    walk([], PROMPT[-1], 1.0)
    return out


def sample(engine, n: int) -> dict:
    counts: dict = {}
    todo, active = list(range(n)), list[Any]()
    while todo or active:
        while todo and engine.free_slots:
            seed = todo.pop()
            req = GenerationRequest(PROMPT, SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=L, seed=seed),
                                    SpeculationParams(mode="tree", tree_depth=3, tree_nodes=6), constraint=SPEC)
            active.append(engine.open_session(req))
        engine.tick(active)
        for s in list(active):
            if s.done:
                k = tuple(s.out[:L])
                counts[k] = counts.get(k, 0) + 1
                s.close()
                active.remove(s)
    return counts


def p_value(engine, counts: dict) -> float:
    e = exact(engine)
    keys = sorted(set(e) | set(counts))
    return chi_square_gof(np.array([counts.get(k, 0) for k in keys]), np.array([e.get(k, 0.0) for k in keys]))[2]


def test_schema_sampling_at_t1_matches_the_masked_target(engine):
    e = exact(engine)
    assert 9 <= len(e) <= TOP_K ** L and abs(sum(e.values()) - 1) < 1e-9
    counts = sample(engine, SAMPLES)
    text = [engine.target.detokenize(k) for k in counts]
    assert all(t.startswith('{"') for t in text)  # the grammar held
    assert p_value(engine, counts) > ALPHA, counts


def test_a_drafter_reporting_the_unmasked_q_is_rejected(engine, monkeypatch):
    """Drawn from the masked q, reported unmasked. Untruncated: with top_k the unmasked q mostly
    gives the drawn token zero mass, which the verifier refuses loudly; the subtle bias is the
    one where every drawn token keeps some mass."""
    from edgespec.drafters import grow

    full = SamplingParams(temperature=1.0)

    real = grow.Growth.build

    def build(self, tree, max_leaves, rep):
        remap = real(self, tree, max_leaves, rep)
        for cand, node in remap.items():
            if tree.q[node] is not None:
                tree.q[node] = logits_to_probs(self.logits[cand], full)
        return remap

    monkeypatch.setattr(grow.Growth, "build", build)
    assert p_value(engine, sample(engine, SAMPLES)) < ALPHA


def test_rows_masked_by_the_parents_state_are_rejected(engine, monkeypatch):
    from edgespec import constraint

    real = constraint.Matcher.node_bits

    def parents(self, tree):
        nm = real(self, tree)
        idx = [max(0, p) for p in tree.parents]
        return constraint.NodeMasks(nm.bits[idx], nm.valid[idx], nm.n_vocab)

    monkeypatch.setattr(constraint.Matcher, "node_bits", parents)
    with pytest.raises(RuntimeError, match="not allowed"):  # a forbidden token reaches the commit
        sample(engine, SAMPLES)
