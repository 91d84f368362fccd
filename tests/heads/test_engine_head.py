"""The EAGLE-3 head as the engine's draft (`[draft] path` = a head GGUF), through Engine and
Session: greedy output equals plain greedy in chain, tree and auto modes; sessions batched in
one tick give what each gives alone, every level of all of them in one head forward; the head
context's KV invariant holds after every tick; at temperature 1 the first two tokens follow the
target's exact distribution, and the same test rejects an engine whose head reports another
distribution than the one it drew its children from. Acceptance through the engine depends on the
target features reaching the head from the right rows."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edgespec import backend
from edgespec.config import EngineConfig, ModelConfig
from edgespec.sampling import SamplingParams, logits_to_probs
from edgespec.selftest import ALPHA
from edgespec.types import GenerationRequest, SpeculationParams
from tests.heads.conftest import TRAIN_PROMPTS, synthetic_prompts
from tests.tick.test_batched import TOP_K, exact_joint, gof

pytestmark = pytest.mark.slow

N_TOKENS = 32


def load(demo_pair, tiny_head, parallel: int, n_ctx: int = 512):
    from edgespec.engine import Engine

    t = ModelConfig(str(demo_pair.target), n_ctx=n_ctx, n_batch=256, threads=1)
    h = ModelConfig(str(tiny_head["path"]), n_ctx=n_ctx, n_batch=256, threads=1)
    return Engine.load(EngineConfig(t, h, parallel=parallel))


@pytest.fixture(scope="module")
def head_engine(demo_pair, tiny_head):
    eng = load(demo_pair, tiny_head, parallel=3)
    yield eng
    eng.close()


def prompts(eng) -> list[list[int]]:
    """Two answers the head was trained on (long acceptances) and one it never saw."""
    texts = synthetic_prompts(TRAIN_PROMPTS + 1)
    return [eng.encode_chat([("user", t)]) for t in (texts[0], texts[1], texts[TRAIN_PROMPTS])]


def request(toks, mode: str, n: int = N_TOKENS, **sampling) -> GenerationRequest:
    # the head alone drafts: no suffix cache, whose replay of an earlier answer would be
    # accepted too (and make acceptance say nothing about the head)
    return GenerationRequest(tuple(toks), SamplingParams(max_tokens=n, **sampling),
                             SpeculationParams(mode=mode, suffix=False))


def run(eng, toks, mode: str, n: int = N_TOKENS):
    sess = eng.open_session(request(toks, mode, n))
    sess.check_kv = True  # target and head KV invariants after every tick
    return finish(sess)


def collect_done(active: dict, out: list) -> None:
    """Close the finished sessions of `active` (session -> index), their tokens into `out`."""
    for s, i in list(active.items()):
        if s.done:
            out[i] = s.result().token_ids
            s.close()
            del active[s]


def finish(sess):
    """Tick a session alone to its end; its result."""
    try:
        while not sess.done:
            sess.engine.tick([sess])
        return sess.result()
    finally:
        sess.close()


def test_the_engine_detects_the_head(head_engine):
    eng = head_engine
    assert eng.draft_kind == "eagle3" and eng.features and eng.prompt_cache  # the head keeps its cells too
    assert isinstance(eng.target_ctx, backend.FeatureContext)
    assert isinstance(eng.draft_ctx, backend.HeadContext)
    assert eng.slots[1].draft.ctx is eng.draft_ctx and eng.slots[1].draft.base == eng.slots[1].target.base
    assert eng.cost.draft_seconds(1) > 0  # calibrated on the head's own forwards


def test_feature_context_logits_equal_a_plain_contexts(demo_pair, tiny_head):
    """The target's features cost nothing in exactness: a FeatureContext's logits are a plain
    Context's bit for bit, and its features are gathered over every llama_decode call."""
    target = backend.Model(demo_pair.target)
    head = backend.Model(tiny_head["path"])
    cfg = ModelConfig(str(demo_pair.target), n_ctx=256, n_batch=8, threads=1)  # several llama_decode calls
    fc = backend.FeatureContext(target, cfg, backend.target_layer_ids(head), n_seq_max=2)
    pc = backend.Context(target, cfg, n_seq_max=2)
    toks = target.tokenize("def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)")
    n = len(toks)
    try:
        args = (toks, list(range(n)), [(0,)] * n, [True] * n)
        a = fc.decode_rows(*args)
        b = pc.decode_rows(*args)
        assert np.array_equal(a, b)
        feats = fc.collected()
        assert feats.shape == (n, fc.n_features)
        assert np.array_equal(feats[-(n - 8 * ((n - 1) // 8)):], fc.features())  # the last call's rows at the end
        fc.clear()
        fc.decode_seq(toks[:8], 0)
        assert np.array_equal(fc.features(), feats[:8])  # the first call's rows first
    finally:
        fc.close()
        pc.close()
        head.close()
        target.close()


@pytest.mark.parametrize("mode", ["chain", "tree", "auto"])
def test_greedy_equals_plain(head_engine, mode):
    eng = head_engine
    accepted = 0
    for toks in prompts(eng):
        plain = run(eng, toks, "plain")
        got = run(eng, toks, mode)
        assert got.token_ids == plain.token_ids, f"{mode} differs from plain greedy"
        accepted += got.stats.accepted_tokens
    if mode != "auto":  # auto drafts only where its measured costs say the head pays (timing-dependent)
        assert accepted >= N_TOKENS  # the head really drafted, and was accepted


def test_batched_sessions_equal_each_alone(head_engine):
    """Three sessions in shared ticks (different modes, one arriving later): each gives what it
    gives alone, and each tick runs one head forward per level for all of them (the catch-up of
    the accepted positions riding in the first)."""
    eng = head_engine
    toks = prompts(eng)
    modes = ["tree", "chain", "auto"]
    want = [run(eng, t, "plain").token_ids for t in toks]
    active = {eng.open_session(request(toks[0], modes[0])): 0, eng.open_session(request(toks[1], modes[1])): 1}
    out, ticks, shared = [None] * 3, 0, 0
    try:
        while active:
            if ticks == 2:
                active[eng.open_session(request(toks[2], modes[2]))] = 2
            before = {}
            for s in active:
                s.check_kv = True
                before[s] = s.stats.draft_forwards
            eng.tick(list(active))
            ticks += 1
            rec = eng.last_tick
            drafted = [s.stats.draft_forwards - before[s] for s in active]
            assert rec.draft_forwards <= max(drafted)  # level l of every session in one head forward
            if sum(drafted) > rec.draft_forwards:
                shared += 1
            collect_done(active, out)
    finally:
        for s in active:
            s.close()
    assert shared >= 5
    assert out == want


def test_acceptance_depends_on_the_features_of_the_committed_rows(head_engine, monkeypatch):
    """Exactness cannot tell features of the wrong rows (the target verifies every token):
    acceptance does. On the head's training answers the engine's rows are accepted far more
    often than rows one entry off."""
    from edgespec.session import Session

    eng = head_engine
    toks = prompts(eng)[:2]

    def rate() -> float:
        res = [run(eng, t, "chain") for t in toks]
        return sum(r.stats.accepted_tokens for r in res) / sum(r.stats.target_forwards for r in res)

    right = rate()
    real = Session.verified_features

    def shifted(self, feats):  # the broken path: every row one batch entry late
        real(self, np.concatenate([feats[1:], feats[-1:]]))

    monkeypatch.setattr(Session, "verified_features", shifted)
    off = rate()
    assert right > 1.5 and right > 1.5 * off, (right, off)


def test_the_prompt_cache_keeps_the_heads_positions_with_the_targets_prefill(demo_pair, tiny_head):
    """A request whose prompt continues the last one's context (a chat's next turn) keeps the
    target's prefill and the head's positions alike: nothing of either is computed again, the
    output is plain greedy's, the KV invariants hold, and the head drafts as well as it did on a
    fresh context. A plain request between leaves no head positions: the next request then keeps
    no target prefill either (the head could not catch up without its features) and is still exact."""
    eng = load(demo_pair, tiny_head, parallel=1)
    eng.prompt_store = None  # the slot's own cells only (the store's: tests/heads/test_engine_dual.py)
    try:
        assert eng.prompt_cache
        first, second = prompts(eng)[:2]
        a = run(eng, first, "chain")
        turn = first + a.token_ids + eng.encode_chat([("user", "And again?")])[1:]
        b = run(eng, turn, "chain")
        assert b.stats.cached_prompt_tokens > len(first) // 2
        assert b.stats.draft_cached_tokens >= b.stats.cached_prompt_tokens  # the head kept at least as much
        fresh = load(demo_pair, tiny_head, parallel=1)
        try:
            alone = run(fresh, turn, "chain")
        finally:
            fresh.close()
        assert alone.stats.cached_prompt_tokens == 0 and b.token_ids == alone.token_ids
        assert b.stats.accepted_tokens >= 0.8 * alone.stats.accepted_tokens  # the kept positions are the right ones
        run(eng, second, "plain")
        c = run(eng, second, "chain")
        assert c.stats.cached_prompt_tokens == 0 and c.stats.draft_cached_tokens == 0
        assert c.token_ids == run(eng, second, "plain").token_ids
    finally:
        eng.close()


# -- temperature 1: the head's trees sample the target's distribution -----------------------------

N_SAMPLES = 600


@pytest.fixture(scope="module")
def sampler(demo_pair, tiny_head):
    """Eight slots; a prompt the head was trained on, so that its proposals are accepted often
    (about half of them: acceptances, rejections and residuals are all exercised; on text the
    head never saw nearly every proposal is rejected and the output is the target's own
    residual draw, which no broken drafter could spoil)."""
    eng = load(demo_pair, tiny_head, parallel=8, n_ctx=256)
    toks = eng.encode_chat([("user", synthetic_prompts(1)[0])])
    exact = exact_joint(eng, toks)
    yield eng, toks, exact
    eng.close()


def sample(eng, toks, n: int) -> dict:
    counts: dict = {}
    seeds = list(range(n))
    active: list[Any] = []
    while seeds or active:
        while seeds and eng.free_slots:
            req = GenerationRequest(tuple(toks), SamplingParams(temperature=1.0, top_k=TOP_K, seed=seeds.pop(),
                                                                max_tokens=2),
                                    SpeculationParams(mode="tree", tree_depth=2, tree_nodes=6, suffix=False))
            active.append(eng.open_session(req))
        eng.tick(active)
        for s in [s for s in active if s.done]:
            key = tuple(s.out[:2])
            counts[key] = counts.get(key, 0) + 1
            s.close()
            active.remove(s)
    return counts


def test_sampling_through_the_head_matches_the_target_distribution(sampler):
    eng, toks, exact = sampler
    assert gof(sample(eng, toks, N_SAMPLES), exact) > ALPHA


def test_a_head_reporting_another_distribution_than_it_drew_from_is_caught(sampler, monkeypatch):
    """A broken drafter: the head draws its children at the request's temperature but hands the
    verifier its distribution at twice that (flatter: its proposals are over-accepted). The same
    test must reject it. (Features of the wrong rows would not do: whatever the head is fed, its
    proposals are verified against the distribution they were drawn from, so the output stays
    exact; the acceptance test above catches those.)"""
    report_hotter_than_drawn(monkeypatch)
    eng, toks, exact = sampler
    assert gof(sample(eng, toks, N_SAMPLES // 2), exact) < ALPHA


def report_hotter_than_drawn(monkeypatch) -> None:
    """Break every tree drafter alike: children drawn at the request's temperature, their
    distribution reported to the verifier at twice it."""
    from dataclasses import replace

    from edgespec.drafters import grow

    real = grow.Growth.children

    def children(self, nodes, level, rep):
        new = real(self, nodes, level, rep)
        hot = replace(self.sampling, temperature=2 * self.sampling.temperature)
        for n in nodes:
            if self.qs[n] is not None:
                self.qs[n] = logits_to_probs(self.logits[n], hot)
        return new

    monkeypatch.setattr(grow.Growth, "children", children)
