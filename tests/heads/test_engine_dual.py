"""A head beside the draft model (`EngineConfig.head`, `[draft] head`): each request drafts with
one of them, and sessions drafting with either share ticks. Greedy output equals plain greedy
whichever drafts; a tick runs one forward per drafter context and level; each drafter's KV
invariant holds after every tick; a slot serving both kinds in turn keeps each one's cells for
the next request that drafts with it; the engine chooses by load, and reports which drafter
produced each accepted token."""

from __future__ import annotations

import pytest

from edgespec import backend
from edgespec.config import EngineConfig, ModelConfig
from tests.heads.test_engine_head import N_TOKENS, collect_done, finish, prompts, request

pytestmark = pytest.mark.slow


def load(demo_pair, tiny_head, parallel: int, n_ctx: int = 512):
    from edgespec.engine import Engine

    def cfg(path) -> ModelConfig:
        return ModelConfig(str(path), n_ctx=n_ctx, n_batch=256, threads=1)

    return Engine.load(EngineConfig(cfg(demo_pair.target), cfg(demo_pair.draft), parallel=parallel,
                                    head=cfg(tiny_head["path"])))


@pytest.fixture(scope="module")
def dual(demo_pair, tiny_head):
    eng = load(demo_pair, tiny_head, parallel=3)
    yield eng
    eng.close()


def open_with(eng, toks, mode: str, kind: str, n: int = N_TOKENS):
    real = eng.choose_drafter
    eng.choose_drafter = lambda req, slots=None: kind
    try:
        sess = eng.open_session(request(toks, mode, n))
    finally:
        eng.choose_drafter = real
    sess.check_kv = True  # target, draft and head KV invariants after every tick
    return sess


def run(eng, toks, mode: str, kind: str, n: int = N_TOKENS):
    return finish(open_with(eng, toks, mode, kind, n))


def test_the_engine_holds_both_drafters(dual):
    eng = dual
    assert eng.drafter_kinds == ("model", "eagle3") and eng.features
    assert isinstance(eng.target_ctx, backend.FeatureContext)
    assert isinstance(eng.head_ctx, backend.HeadContext) and not isinstance(eng.draft_ctx, backend.HeadContext)
    s = eng.slots[1]
    assert s.drafter_range("model") is s.draft and s.drafter_range("eagle3") is s.head
    assert s.head.ctx is eng.head_ctx and s.head.base == s.target.base
    assert {"draft", "head"} <= eng.cost.measured  # each calibrated on its own forwards
    assert eng.cost.drafting("head").draft_seconds(1) < eng.cost.draft_seconds(1)
    assert "head" in eng.model_info()


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_greedy_equals_plain_with_either_drafter(dual, kind):
    eng = dual
    other = "head" if kind == "model" else "draft"
    mine = "draft" if kind == "model" else "head"
    accepted = 0
    for toks in prompts(eng):
        plain = run(eng, toks, "plain", kind)
        got = run(eng, toks, "chain", kind)
        assert got.token_ids == plain.token_ids
        assert other not in got.stats.proposed_by_source  # the other drafter never ran for it
        accepted += got.stats.accepted_by_source.get(mine, 0)
    assert accepted >= N_TOKENS // 2  # it really drafted, and was accepted


def test_sessions_of_both_kinds_share_ticks(dual):
    """A head session, a draft-model session and an auto one: each gives what it gives alone, and a
    tick where both drafters ran timed one forward per drafter and level, each on its own curve."""
    eng = dual
    toks = prompts(eng)
    want = [run(eng, t, "plain", "model").token_ids for t in toks]
    kinds = ["eagle3", "model", "eagle3"]
    modes = ["chain", "tree", "auto"]
    active = {open_with(eng, t, m, k): i for i, (t, m, k) in enumerate(zip(toks, modes, kinds))}
    seen = {"draft": 0, "head": 0}
    out, both = [None] * 3, 0
    try:
        while active:
            before = dict(eng.cost.observations)
            drafted = {s: s.stats.draft_forwards for s in active}
            eng.tick(list(active))
            grew = {k: eng.cost.observations[k] - before[k] for k in seen}
            for k in seen:
                seen[k] += grew[k]
            ran = {s.drafter_kind for s in active if s.stats.draft_forwards > drafted[s]}
            if ran == {"model", "eagle3"}:
                both += 1
                assert grew["draft"] >= 1 and grew["head"] >= 1
                assert eng.last_tick.draft_forwards == grew["draft"] + grew["head"]
            collect_done(active, out)
    finally:
        for s in active:
            s.close()
    assert out == want
    assert both >= 3 and seen["draft"] > 0 and seen["head"] > 0


def test_a_slot_keeps_each_drafters_cells_across_requests_of_the_other(demo_pair, tiny_head):
    """One slot: a head request, then a draft-model request, then the head request's next turn.
    The turn keeps the head's positions (the draft-model request between did not touch them), its
    output is plain greedy's, and every KV invariant holds."""
    eng = load(demo_pair, tiny_head, parallel=1)
    try:
        first, second = prompts(eng)[:2]
        a = run(eng, first, "chain", "eagle3")
        held = eng.slots[0].head_cache
        assert held is not None and eng.slots[0].draft_cache is None
        b = run(eng, second, "chain", "model")
        assert eng.slots[0].head_cache is held and eng.slots[0].draft_cache is not None
        assert b.token_ids == run(eng, second, "plain", "model").token_ids
        turn = first + a.token_ids + eng.encode_chat([("user", "And again?")])[1:]
        c = run(eng, turn, "chain", "eagle3")
        assert c.stats.draft_cached_tokens >= len(first)  # the head kept its positions across b
        assert c.token_ids == run(eng, turn, "plain", "model").token_ids
    finally:
        eng.close()


def test_the_engine_chooses_by_load_and_counts_its_choices(dual):
    """After each drafter's first requests, the choice is the estimate's argmax at the load: here
    with the head made to look far more accurate than the draft model, alone and beside others."""
    eng = dual
    ch = eng.drafter_choice
    ch.chosen = {"model": 5, "eagle3": 5}
    ch.explore_every = 10**6
    for k, a in (("model", 0.05), ("eagle3", 0.95)):
        p = eng.priors[k]
        p.rates = [[a] * p.ranks for _ in range(p.depths)]
    toks = prompts(eng)[0]
    sessions = [eng.open_session(request(toks, "auto", 4)) for _ in range(2)]
    try:
        assert [s.drafter_kind for s in sessions] == ["eagle3", "eagle3"]
        assert [s.slot.drafting for s in sessions] == ["eagle3", "eagle3"]
        assert ch.last["eagle3"] > ch.last["model"]
        plain = eng.open_session(request(toks, "plain", 4))
        assert plain.drafter_kind == "model"  # a plain request keeps the most of a prompt
        plain.close()
    finally:
        for s in sessions:
            s.close()
    assert all(s.drafting is None for s in eng.slots)


def test_a_draft_model_request_copies_another_slots_prefill_and_the_choice_prices_it(demo_pair, tiny_head):
    """A prompt whose prefill another slot holds, and no head positions anywhere: a draft-model
    request copies those cells and prefills nothing, a head's request would prefill it all; the
    choice's one-off cost of each says so."""
    eng = load(demo_pair, tiny_head, parallel=2)
    try:
        assert eng.prompt_cache
        toks = prompts(eng)[0]
        holder = eng.open_session(request(toks, "plain", 8))
        while holder.prefilling:
            eng.tick([holder])
        assert holder.slot.prefill == tuple(toks[:-1])  # shared from now on
        req = request(toks, "chain", 4)
        other = next(s for s in eng.slots if not s.busy)
        assert eng.pool.kept_prefill(other, req, "model") == (len(toks) - 1, holder.slot, None)
        assert eng.pool.kept_prefill(other, req, "eagle3") == (0, None, None)
        cost = {k: eng.cost.drafting(eng.cost_kind(k)) for k in ("model", "eagle3")}
        backlog = min(len(toks) - 1, eng.cfg.draft_window)
        assert eng._once_seconds(req, other, "model") == pytest.approx(
            cost["model"].verify_seconds(1) + cost["model"].draft_seconds(backlog))
        assert eng._once_seconds(req, other, "eagle3") == pytest.approx(
            cost["eagle3"].verify_seconds(len(toks) - 1) + cost["eagle3"].draft_seconds(len(toks) - 1))
        sess = open_with(eng, toks, "chain", "model", 4)
        assert sess.slot is other and sess.stats.cached_prompt_tokens == len(toks) - 1
        assert finish(sess).token_ids == run(eng, toks, "plain", "model", 4).token_ids
        holder.close()
    finally:
        eng.close()


def test_a_heads_request_copies_the_head_positions_and_the_prefill_of_another_slot(demo_pair, tiny_head):
    """A head's request keeps what the other slot holds of its prompt, the head's positions and
    features as well as the target's prefill, while that slot serves a draft-model request (the
    head's cells there are untouched), or while a request drafting with the head runs there; the
    output is plain greedy's and every KV invariant holds. Before, a head's request kept only what
    its own slot held, and prefilled the whole prompt."""
    eng = load(demo_pair, tiny_head, parallel=2)
    try:
        toks = prompts(eng)[0]
        want = run(eng, toks, "chain", "eagle3").token_ids
        first = next(s for s in eng.slots if s.head_cache is not None)
        held = first.head_cache
        holder = open_with(eng, toks, "plain", "model", 8)  # the same prompt: the slot keeps its prefill
        assert holder.slot is first and not holder.prefilling
        assert first.prefill == tuple(toks[:-1])  # kept whole: shared from the start
        other = next(s for s in eng.slots if s is not first)
        assert other.head_cache is None and other.prefill == ()
        sess = open_with(eng, toks, "chain", "eagle3")
        assert sess.slot is other and first.head_cache is held  # lent, not taken
        # all but the root's parent, which the head decodes again (HeadCache.reusable)
        assert sess.stats.cached_prompt_tokens == sess.stats.draft_cached_tokens == len(toks) - 2
        assert finish(sess).token_ids == want
        holder.close()
        # a request drafting with the head lends its prompt's head positions and features, once
        # it has read the prompt, to a request on a slot that holds nothing
        busy = open_with(eng, toks, "chain", "eagle3")
        while busy.prefilling:
            eng.tick([busy])
        empty = next(s for s in eng.slots if not s.busy)
        empty.reset()
        keep, donor, hdonor = eng.pool.kept_prefill(empty, request(toks, "chain"), "eagle3")
        # all of it: the lent features include the root's parent's, which the head had not absorbed
        assert keep == len(toks) - 1 and donor is busy.slot and hdonor is busy.slot
        # and the choice prices the loan: nothing to prefill, nothing for the head to catch up on
        head_cost = eng.cost.drafting(eng.cost_kind("eagle3"))
        assert eng._once_seconds(request(toks, "chain"), empty, "eagle3") == pytest.approx(
            head_cost.verify_seconds(1) + head_cost.draft_seconds(1))
        lent = open_with(eng, toks, "chain", "eagle3")
        assert lent.slot is empty and lent.stats.cached_prompt_tokens == len(toks) - 1
        while not (busy.done and lent.done):  # side by side, every KV invariant checked
            eng.tick([s for s in (busy, lent) if not s.done])
        assert busy.result().token_ids == lent.result().token_ids == want
        busy.close()
        lent.close()
    finally:
        eng.close()


# -- temperature 1: ticks mixing both drafters sample the target's distribution ------------------

N_SAMPLES = 600


@pytest.fixture(scope="module")
def mixed_sampler(demo_pair, tiny_head):
    """Eight slots, every other request drafting with the head (by its seed's parity), the others
    with the draft model, in shared ticks; the prompt the head was trained on (tests/heads/
    test_engine_head.py: sampler)."""
    from tests.heads.conftest import synthetic_prompts
    from tests.tick.test_batched import exact_joint

    eng = load(demo_pair, tiny_head, parallel=8, n_ctx=256)
    eng.choose_drafter = lambda req, slots=None: ("model", "eagle3")[req.sampling.seed % 2]
    toks = eng.encode_chat([("user", synthetic_prompts(1)[0])])
    exact = exact_joint(eng, toks)
    yield eng, toks, exact
    eng.close()


def test_ticks_mixing_both_drafters_sample_the_target_distribution(mixed_sampler):
    from edgespec.selftest import ALPHA
    from tests.heads.test_engine_head import sample
    from tests.tick.test_batched import gof

    eng, toks, exact = mixed_sampler
    before = dict(eng.cost.observations)
    assert gof(sample(eng, toks, N_SAMPLES), exact) > ALPHA
    assert eng.cost.observations["draft"] > before["draft"] and eng.cost.observations["head"] > before["head"]


def test_a_drafter_reporting_another_distribution_is_caught_in_mixed_ticks(mixed_sampler, monkeypatch):
    """The broken twin of tests/heads/test_engine_head.py (children drawn at the request's
    temperature, reported at twice it), in ticks mixing both drafters: rejected."""
    from edgespec.selftest import ALPHA
    from tests.heads.test_engine_head import report_hotter_than_drawn, sample
    from tests.tick.test_batched import gof

    report_hotter_than_drawn(monkeypatch)
    eng, toks, exact = mixed_sampler
    assert gof(sample(eng, toks, N_SAMPLES // 2), exact) < ALPHA


def test_the_prompt_store_gives_back_what_a_slot_dropped(demo_pair, tiny_head):
    """One slot: a head's request, then one on another prompt (the slot drops the first prompt's
    prefill; the prompt store keeps its cells, and the head's positions and features), then the
    first prompt again: all of it comes back from host memory, as from another slot, and the
    output is plain greedy's with every KV invariant checked. A plain request's root logits from
    cells written back are an empty cache's bit for bit. Another caller's request gets nothing
    back, nor any of the slot's cells (one partition per caller)."""
    import dataclasses

    import numpy as np

    eng = load(demo_pair, tiny_head, parallel=1)
    try:
        store, slot = eng.prompt_store, eng.slots[0]
        assert store is not None and eng.batch_invariant
        first, second = prompts(eng)[:2]
        want = run(eng, first, "plain", "model").token_ids
        slot.reset()
        store.clear()
        run(eng, first, "chain", "eagle3")
        assert len(store) == 0  # nothing dropped yet
        run(eng, second, "chain", "eagle3")
        (kept,) = store.candidates("")
        assert kept.prefill == tuple(first[:-1]) and kept.head is not None and store.bytes == kept.nbytes
        sess = open_with(eng, first, "chain", "eagle3")
        # all but the root's parent, which the head decodes again (HeadCache.reusable)
        assert sess.stats.cached_prompt_tokens == sess.stats.draft_cached_tokens == len(first) - 2
        assert finish(sess).token_ids == want
        assert store.figures()["hits"] == 1 and len(store) == 2  # second's prefill went in

        def root_logits(toks, caller=""):
            req = dataclasses.replace(request(toks, "plain", 4), caller=caller)
            sess = eng.open_session(req)
            try:
                sess.step()  # the last piece's forward, the root last in it
                return sess.stats.cached_prompt_tokens, slot.target.logits(-1).copy()
            finally:
                sess.close()

        slot.reset()
        store.clear()
        n0, l0 = root_logits(first)  # from an empty cache; the slot keeps the prefill
        run(eng, second, "plain", "model")  # drops it: the store keeps it
        n1, l1 = root_logits(first)
        assert (n0, n1) == (0, len(first) - 1) and np.array_equal(l0, l1)
        run(eng, second, "plain", "model")
        # another partition: nothing, not even the chat template's few tokens the slot's cells share
        template = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
        assert template > 0 and root_logits(first, caller="token:bob")[0] == 0
        assert root_logits(first)[0] == len(first) - 1
    finally:
        eng.close()
