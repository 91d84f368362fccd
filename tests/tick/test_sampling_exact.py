"""The tick samples the target's distribution at T > 0: fake backend, fast, with power.

Eight tree sessions per tick (EAGLE-2 trees of depth 2, 6 nodes: sibling draws without
replacement, residuals, bonus tokens), each request emitting its first two tokens at
temperature 1, top_k 4, over two prompts. The exact joint distribution of those two tokens is
computed from the fake target's bigram table; the draft is the table plus noise (sd 1.5 on logits
of sd 3), so verification goes through rejections and residuals at both levels.

Power. Pearson chi-square at alpha = 1e-3 on the 16 cells of each prompt, N samples each. Any
distribution at total-variation distance d from the exact one has chi-square divergence at least
4 d^2 (Cauchy-Schwarz), i.e. noncentrality >= 4 N d^2. With N = SAMPLES = 2500 and 15 degrees of
freedom, noncentrality 46 gives power 0.95 (scipy.stats.ncx2), so the test rejects every
alternative at TV >= MIN_TV = sqrt(46 / (4 N)) ~ 0.068 with power >= 0.95, whatever its shape
(`test_stated_power` checks the arithmetic). Three broken engines, each a test-local twin, are
rejected on both prompts' counts (fixed seeds, deterministic):

- a drafter that draws its children at temperature T but reports q at 1.25 T;
- each node's q taken from the wrong node (its parent's distribution);
- rows from the wrong session (each session given another's rows of the target forward);
- a verifier handed a flat q instead of the draft's distribution.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edgespec.sampling import SamplingParams, logits_to_probs
from edgespec.selftest import ALPHA, chi_square_gof
from edgespec.types import GenerationRequest, SpeculationParams
from tests.fake_backend import EOS, bigram_table, fake_backed_engine

TOP_K = 4
SAMPLES = 2500  # per prompt
NONCENTRALITY = 46.0  # chi-square(15) at alpha 1e-3: power 0.95
MIN_TV = float(np.sqrt(NONCENTRALITY / (4 * SAMPLES)))
PROMPTS = ((0, 5, 9), (0, 7, 21))
SAMPLING = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=2)


def key_of(a: int, b: int) -> tuple[int, ...]:
    """What a request emits: an end-of-generation token ends it and is not part of the output."""
    if a == EOS:
        return ()
    return (a,) if b == EOS else (a, b)


def exact_joint(prompt, top_k: int = TOP_K) -> dict:
    table, s = bigram_table(), SamplingParams(temperature=1.0, top_k=top_k)
    p1 = logits_to_probs(table[prompt[-1]], s)
    out: dict = {}
    for a in np.flatnonzero(p1):
        p2 = logits_to_probs(table[a], s)
        for b in np.flatnonzero(p2):
            k = key_of(int(a), int(b))
            out[k] = out.get(k, 0.0) + p1[a] * p2[b]
    return out


def sample(n_each: int, top_k: int = TOP_K, seed0: int = 0) -> list[dict]:
    eng = fake_backed_engine(parallel=8, draft_noise=1.5)
    counts: list[dict[Any, int]] = [{} for _ in PROMPTS]
    todo = [(j, seed0 + i) for i in range(n_each) for j in range(len(PROMPTS))]
    active: dict = {}
    while todo or active:
        while todo and eng.free_slots:
            j, seed = todo.pop()
            s = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=2, seed=seed)
            req = GenerationRequest(PROMPTS[j], s, SpeculationParams(mode="tree", tree_depth=2, tree_nodes=6))
            active[eng.open_session(req)] = j
        eng.tick(list(active))
        for sess, j in list(active.items()):
            if sess.done:
                k = tuple(sess.out[:2])
                counts[j][k] = counts[j].get(k, 0) + 1
                sess.close()
                del active[sess]
    return counts


def p_values(counts: list[dict], top_k: int = TOP_K) -> list[float]:
    out = []
    for c, prompt in zip(counts, PROMPTS):
        exact = exact_joint(prompt, top_k)
        keys = sorted(set(exact) | set(c))
        out.append(chi_square_gof(np.array([c.get(k, 0) for k in keys]),
                                  np.array([exact.get(k, 0.0) for k in keys]))[2])
    return out


def test_stated_power():
    stats = pytest.importorskip("scipy.stats")
    dof = TOP_K * TOP_K - 1
    crit = stats.chi2.ppf(1 - ALPHA, dof)
    assert stats.ncx2.sf(crit, dof, NONCENTRALITY) >= 0.95
    assert MIN_TV < 0.07


def test_tree_sampling_through_the_tick_matches_the_target():
    counts = sample(SAMPLES)
    assert all(sum(c.values()) == SAMPLES for c in counts)
    assert min(p_values(counts)) > ALPHA, counts


def test_untruncated_tree_sampling_matches_the_target():
    """top_k off: the whole vocabulary (cells expected below 5 pooled)."""
    assert min(p_values(sample(SAMPLES, top_k=0), top_k=0)) > ALPHA


# -- the broken twins -------------------------------------------------------------------------


def _rebuild_q(monkeypatch, q_of):
    """Patch tree building so that tree node r's q becomes q_of(growth, candidate, sampling)."""
    from edgespec.drafters import grow

    real = grow.Growth.build

    def build(self, tree, max_leaves, rep):
        remap = real(self, tree, max_leaves, rep)
        if not self.greedy:
            for cand, node in remap.items():
                if tree.q[node] is not None:
                    tree.q[node] = q_of(self, cand)
        return remap

    monkeypatch.setattr(grow.Growth, "build", build)


def test_q_reported_at_a_hotter_temperature_is_rejected(monkeypatch):
    """The drafter draws from q at T but reports q at 1.25 T."""
    def hot(g, cand):
        s = SamplingParams(temperature=1.25 * g.sampling.temperature, top_k=g.sampling.top_k)
        return logits_to_probs(g.logits[cand], s)

    _rebuild_q(monkeypatch, hot)
    assert min(p_values(sample(SAMPLES))) < ALPHA


def test_q_from_the_wrong_node_is_rejected(monkeypatch):
    """Each node's children verified against its parent's draft distribution. Untruncated (with
    top_k the wrong q mostly gives a drafted token zero mass, which the verifier refuses loudly;
    the subtle bias is the one where every token keeps some mass)."""
    _rebuild_q(monkeypatch, lambda g, cand: g.qs[g.parent[cand]] if cand else g.qs[0])
    assert min(p_values(sample(SAMPLES, top_k=0), top_k=0)) < ALPHA


def test_rows_from_the_wrong_session_are_rejected(monkeypatch):
    """Each session verified on the rows of another session with as many rows."""
    import edgespec.tick as tick_mod
    from edgespec.tick import forward

    real = forward.verify_forward

    def crossed(engine, plan):
        rec = real(engine, plan)
        by_len: dict[int, list] = {}
        for s in plan.decoding:
            if s in rec.rows:
                by_len.setdefault(len(rec.rows[s]), []).append(s)
        for group in by_len.values():
            rows = [rec.rows[s] for s in group]
            for s, r in zip(group, rows[1:] + rows[:1]):
                rec.rows[s] = r
        return rec

    monkeypatch.setattr(tick_mod, "verify_forward", crossed)
    assert min(p_values(sample(SAMPLES))) < ALPHA


def flat_q(tree):
    """The tree with every draft distribution replaced by a uniform one (a verifier that does
    not use the draft's distribution)."""
    import dataclasses

    return dataclasses.replace(tree, q=[None if q is None else np.full(len(q), 1.0 / len(q)) for q in tree.q])


def test_verifying_without_the_drafts_distribution_is_rejected(monkeypatch):
    import edgespec.tick.verdict as verdict

    real = verdict.verify_stochastic
    monkeypatch.setattr(verdict, "verify_stochastic", lambda tree, probs, rng: real(flat_q(tree), probs, rng))
    assert min(p_values(sample(SAMPLES))) < ALPHA
