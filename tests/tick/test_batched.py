"""The batched tick on the demo pair: several sessions verified in one target forward.

Exactness under batching: greedy output of every request equals that request decoded alone in
plain mode, with requests of different lengths and modes, arrivals mid-stream, a cancel in the
middle and a long prompt prefilled in pieces; the KV invariants hold for every session after
every tick. At temperature 1 the batched path samples the target's distribution: checked
against the exact distribution (computed from the target's own logits) with a draft far from
the target, and the same check rejects an engine that hands a session another session's rows,
leaves a residual unnormalised, or verifies with a flat q instead of the draft's distribution.
(The fast tier's fake-backend twin: tests/tick/test_sampling_exact.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.sampling import SamplingParams
from edgespec.selftest import ALPHA, chi_square_gof
from edgespec.types import GenerationRequest, SpeculationParams

pytestmark = pytest.mark.slow

PROMPTS = [
    ("Write a Python function that checks whether a number is prime.", "auto"),
    ('Extract the person, company and date as JSON from: "On 3 March 2021, Alice Smith joined Initech as CTO."',
     "chain"),
    ("Continue this contract clause: The Licensee shall not sublicense, assign or transfer", "tree"),
    ("List five tips for writing clean code.", "plain"),
    ("Explain the difference between a list and a tuple in Python.", "auto"),
    ("Write a SQL query that returns the ten most recent orders with their customer names.", "tree"),
]
LONG = ("Context: " + " ".join(f"Clause {i}: the supplier delivers goods of grade {i % 7} within {i + 3} days."
                               for i in range(40)) + " Question: which clause has grade 3 and 24 days?")


@pytest.fixture(scope="module")
def batched(demo_pair):
    from edgespec.config import EngineConfig, ModelConfig
    from edgespec.engine import Engine

    cfg = EngineConfig(ModelConfig(str(demo_pair.target), n_ctx=1024, n_batch=256),
                       ModelConfig(str(demo_pair.draft), n_ctx=1024, n_batch=256), parallel=4)
    eng = Engine.load(cfg)
    yield eng
    eng.close()


def alone(engine, toks, max_tokens):
    req = GenerationRequest(tuple(toks), SamplingParams(max_tokens=max_tokens), SpeculationParams(mode="plain"))
    return engine.generate(req).token_ids


def drive(engine, jobs, cancel=None):
    """Run `jobs` [(arrival tick, prompt tokens, mode, max_tokens)] through shared ticks; at most
    `len(engine.slots)` at once (the others wait, as the daemon's queue does). `cancel`: (index,
    tokens) ends that request mid-stream, once it has emitted that many tokens (not at a fixed
    tick: how many ticks the others take, and so when a slot frees, follows the controller's
    measured costs, and a suffix-cache hit can emit a whole answer in a few ticks). Returns each
    request's token ids (None if cancelled)."""
    waiting = sorted(range(len(jobs)), key=lambda i: jobs[i][0])
    active, out, tick = {}, [None] * len(jobs), 0
    ticks_shared = 0
    while waiting or active:
        while waiting and jobs[waiting[0]][0] <= tick and engine.free_slots:
            i = waiting.pop(0)
            _, toks, mode, n = jobs[i]
            s = engine.open_session(GenerationRequest(tuple(toks), SamplingParams(max_tokens=n),
                                                      SpeculationParams(mode=mode)))
            s.check_kv = True  # every session's invariants after every tick it verifies in
            active[s] = i
        if cancel is not None:
            for s, i in list(active.items()):
                if i == cancel[0] and len(s.out) >= cancel[1] and not s.done:
                    s.close("cancelled")
                    del active[s]
        if active:
            ticks_shared += len(active) > 1
            engine.tick(list(active))
            for s, i in list(active.items()):
                if s.done:
                    out[i] = list(s.out) if s.finish_reason != "cancelled" else None
                    s.close()
                    del active[s]
        tick += 1
    return out, ticks_shared


def test_concurrent_greedy_equals_each_request_alone(batched):
    eng = batched
    prompts = [eng.encode_chat([("user", p)]) for p, _ in PROMPTS]
    long_toks = eng.encode_chat([("user", LONG)])
    assert len(long_toks) > 2 * eng.cfg.target.n_batch  # prefilled in pieces, across chunk boundaries
    max_tokens = [64, 48, 80, 40, 72, 56]
    jobs = [(2 * i, t, m, n) for i, ((_, m), t, n) in enumerate(zip(PROMPTS, prompts, max_tokens))]
    jobs.append((3, long_toks, "auto", 40))  # arrives while four streams decode
    jobs.append((4, prompts[0], "tree", 64))  # cancelled mid-stream
    out, shared = drive(eng, jobs, cancel=(len(jobs) - 1, 1))
    assert shared > 20  # the ticks really batched several sessions
    assert out[-1] is None
    for (_arrive, toks, mode, n), got in zip(jobs[:-1], out[:-1]):
        ref = alone(eng, toks, n)
        # batch-invariant forwards (tools/patches/): token for token, no near-tie allowance
        assert got == ref, f"{mode} request diverged from its plain run alone"


def test_tick_verifies_every_decoding_session_in_one_target_forward(batched):
    eng = batched
    toks = [eng.encode_chat([("user", p)]) for p, _ in PROMPTS[:4]]
    sess = [eng.open_session(GenerationRequest(tuple(t), SamplingParams(max_tokens=128),
                                               SpeculationParams(mode=m))) for t, (_, m) in zip(toks, PROMPTS)]
    try:
        calls = []
        ctx = eng.target_ctx
        real = ctx.decode_rows

        def counting(tokens, *a, **k):
            calls.append(len(tokens))
            return real(tokens, *a, **k)

        ctx.decode_rows = counting
        while any(s.prefilling for s in sess):
            eng.tick(sess)
        calls.clear()
        # a session that drafts from the engine's history (this module's earlier replies in its
        # suffix cache) may have finished while the others prefilled
        live = [s for s in sess if not s.done]
        eng.tick(sess)
        rec = eng.last_tick
        assert len(live) >= 2
        assert rec.decoding == len(live) and len(calls) == 1 and calls[0] == rec.verify_tokens >= len(live)
        assert rec.draft_forwards <= max(s.spec.tree_depth for s in sess) + 1
    finally:
        ctx.decode_rows = real
        for s in sess:
            s.close()


def test_load_shrinks_speculation(batched):
    """With four auto sessions on a CPU, verification tokens cost more than alone: the joint
    schedule verifies fewer tokens than the sessions' own choices would, and its expected rate
    (tokens per second of the whole tick, on the measured curves) is at least theirs."""
    from edgespec.tick.schedule import _rung_of, _tick_seconds, schedule

    eng = batched
    toks = eng.encode_chat([("user", PROMPTS[0][0])])
    sess = [eng.open_session(GenerationRequest(tuple(toks), SamplingParams(max_tokens=200))) for _ in range(4)]
    saved = eng.cost
    try:
        for _ in range(12):  # past the first plain step, acceptance learnt
            eng.tick(sess)
        # the CPU curves of docs/controller.md (F32 target, Q4_0 draft): what this checks is the
        # schedule on the sessions' real acceptance, not how loaded the host was meanwhile
        from edgespec.controller import CostModel

        cpu = CostModel.from_tables({1: 0.036, 2: 0.036, 4: 0.047, 8: 0.065, 16: 0.080},
                                    {1: 0.011, 2: 0.015, 4: 0.022, 8: 0.036, 16: 0.064}, alpha=0.0)
        eng.cost = cpu
        for s in sess:
            s.controller.cost, s.controller.spec_bias = cpu, 1.0
            s.controller._overhead = {"plain": 0.0, "spec": 0.0}
            s.controller.breaker.state = "closed"
        solo = [s.decide().shape for s in sess]
        plan = schedule(eng, sess)  # begins no step (tick.start does)
        joint = [plan.steps[s].shape for s in sess]
        cost = eng.cost.at(plan.context, plan.sequences)

        def rate(shapes):
            rungs = [_rung_of(eng, s, sh, cost) for s, sh in zip(sess, shapes)]
            return sum(r.tokens for r in rungs) / _tick_seconds(rungs, cost)

        solo_tokens = sum(sh.nodes + 1 for sh in solo)
        assert solo_tokens >= 8, solo  # the sessions do want to speculate
        # the premise: on this CPU four trees cost clearly more to verify than four roots
        assert cost.verify_seconds(solo_tokens) > 1.3 * cost.verify_seconds(len(sess))
        assert sum(sh.nodes for sh in joint) < sum(sh.nodes for sh in solo), (joint, solo)
        assert rate(joint) >= rate(solo) * (1 - 1e-9)
    finally:
        eng.cost = saved
        for s in sess:
            s.close()


# -- temperature 1: the batched path samples the target's distribution ----------------------------

SAMPLE_PROMPTS = ("The capital of France is", "def fibonacci(n):")
TOP_K = 5


@pytest.fixture(scope="module")
def far_engine(demo_pair, tmp_path_factory):
    """Eight slots, and the target quantized to 2 bits as the draft: its proposals overlap the
    target's but are far from its distribution, so verification goes through rejections and the
    residual distributions (a random-weights draft would be rejected outright, leaving the
    residual equal to the target and a broken residual unseen)."""
    from edgespec import backend
    from edgespec.config import EngineConfig, ModelConfig
    from edgespec.engine import Engine

    far = tmp_path_factory.mktemp("far") / "q2k.gguf"
    backend.quantize(demo_pair.target, far, "q2_k")
    cfg = EngineConfig(ModelConfig(str(demo_pair.target), n_ctx=256), ModelConfig(str(far), n_ctx=256), parallel=8)
    eng = Engine.load(cfg)
    yield eng
    eng.close()


def exact_joint(engine, toks) -> dict:
    """The target's own distribution of the first two tokens (top_k, temperature 1)."""
    from edgespec.sampling import logits_to_probs

    s = SamplingParams(temperature=1.0, top_k=TOP_K)
    first, _ = engine.next_logits(toks)
    p1 = logits_to_probs(first, s)
    out = {}
    for a in np.flatnonzero(p1):
        second, _ = engine.next_logits(list(toks) + [int(a)])
        p2 = logits_to_probs(second, s)
        for b in np.flatnonzero(p2):
            out[(int(a), int(b))] = p1[a] * p2[b]
    return out


def sample_batched(engine, prompts, n_each, mode="tree"):
    """n_each samples of the first two tokens per prompt, eight sessions per tick."""
    counts = [dict() for _ in prompts]
    todo = [(j, seed) for seed in range(n_each) for j in range(len(prompts))]
    active = {}
    while todo or active:
        while todo and engine.free_slots:
            j, seed = todo.pop()
            req = GenerationRequest(tuple(prompts[j]), SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed,
                                                                      max_tokens=2),
                                    SpeculationParams(mode=mode, tree_depth=2, tree_nodes=6))
            active[engine.open_session(req)] = j
        engine.tick(list(active))
        for s, j in list(active.items()):
            if s.done:
                key = tuple(s.out[:2])
                counts[j][key] = counts[j].get(key, 0) + 1
                s.close()
                del active[s]
    return counts


def gof(counts: dict, exact: dict) -> float:
    keys = sorted(set(exact) | set(counts))
    c = np.array([counts.get(k, 0) for k in keys])
    p = np.array([exact.get(k, 0.0) for k in keys])
    return chi_square_gof(c, p)[2]


N_SAMPLES = 400


@pytest.fixture(scope="module")
def exact_dists(far_engine):
    prompts = [far_engine.tokenize(p) for p in SAMPLE_PROMPTS]
    return prompts, [exact_joint(far_engine, t) for t in prompts]


def test_batched_sampling_matches_the_target_distribution(far_engine, exact_dists):
    prompts, exact = exact_dists
    counts = sample_batched(far_engine, prompts, N_SAMPLES)
    for c, e in zip(counts, exact):
        assert gof(c, e) > ALPHA, (c, e)


def test_a_session_given_another_sessions_rows_is_caught(far_engine, exact_dists, monkeypatch):
    """A broken engine path: the tick hands each session the rows of the session verified
    before it in the forward (with equal batch sizes). The same test must reject it."""
    import edgespec.tick as tick_mod
    from edgespec.tick import forward

    real = forward.verify_forward

    def crossed(engine, plan):
        rec = real(engine, plan)
        ss = [s for s in plan.decoding if s in rec.rows]
        by_len: dict[int, list] = {}
        for s in ss:
            by_len.setdefault(len(rec.rows[s]), []).append(s)
        for group in by_len.values():
            rows = [rec.rows[s] for s in group]
            for s, r in zip(group, rows[1:] + rows[:1]):
                rec.rows[s] = r
        return rec

    monkeypatch.setattr(tick_mod, "verify_forward", crossed)
    prompts, exact = exact_dists
    counts = sample_batched(far_engine, prompts, N_SAMPLES // 2)
    assert min(gof(c, e) for c, e in zip(counts, exact)) < ALPHA


def test_an_unnormalised_residual_is_caught(far_engine, exact_dists, monkeypatch):
    """A broken engine path: after a rejection the next sibling is checked against max(0, p - q)
    left unnormalised. The same test must reject it."""
    import edgespec.verify as verify

    monkeypatch.setattr(verify, "residual", lambda p, q: np.maximum(p - q, 0.0))
    prompts, exact = exact_dists
    counts = sample_batched(far_engine, prompts, N_SAMPLES // 2)
    assert min(gof(c, e) for c, e in zip(counts, exact)) < ALPHA


def test_verifying_with_a_flat_q_is_caught(far_engine, exact_dists, monkeypatch):
    """A broken engine path: the verifier is handed a uniform q instead of the draft's
    distribution (accepting nearly every draft). The same test must reject it."""
    import dataclasses

    import edgespec.tick.verdict as verdict

    real = verdict.verify_stochastic

    def flat(tree, probs, rng):
        qs = [None if q is None else np.full(len(q), 1.0 / len(q)) for q in tree.q]
        return real(dataclasses.replace(tree, q=qs), probs, rng)

    monkeypatch.setattr(verdict, "verify_stochastic", flat)
    prompts, exact = exact_dists
    counts = sample_batched(far_engine, prompts, N_SAMPLES // 4)  # a gross bias: fewer samples do
    assert min(gof(c, e) for c, e in zip(counts, exact)) < ALPHA
