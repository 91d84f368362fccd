"""The engine tick on a fake backend (scripted bigram logits, a fake unified KV cache): the
phases, the KV commit per sequence range, prefill pieces, emit. Fast; the real models are in
tests/test_batched.py."""

from __future__ import annotations

import pytest

from edgespec.sampling import SamplingParams
from edgespec.types import GenerationRequest, SpeculationParams
from tests.fake_backend import EOS, fake_engine


def req(prompt, mode="auto", max_tokens=40, **spec):
    return GenerationRequest(tuple(prompt), SamplingParams(max_tokens=max_tokens),
                             SpeculationParams(mode=mode, **spec))


PROMPTS = [[0, 5, 9, 14], [0, 7, 7, 7, 21, 30], [0, 11], [0, 40, 41, 42, 43, 44, 45, 46]]


def run_alone(eng, prompt, n):
    return eng.generate(req(prompt, "plain", n)).token_ids


def test_batched_greedy_equals_each_alone_and_one_target_forward_per_tick():
    eng = fake_engine(parallel=4)
    modes = ["plain", "chain", "tree", "auto"]
    refs = [run_alone(eng, p, 40) for p in PROMPTS]
    sess = [eng.open_session(req(p, m)) for p, m in zip(PROMPTS, modes)]
    for s in sess:
        s.check_kv = True
    tctx = eng.target_ctx
    while any(not s.done for s in sess):
        live = [s for s in sess if not s.done]
        before = len(tctx.decodes)
        eng.tick(live)
        rec = eng.last_tick
        if rec.decoding:  # one decode with every tree, then one per prefill piece
            assert tctx.decodes[before] == rec.verify_tokens
            assert len(tctx.decodes) - before == 1 + (rec.sessions - rec.decoding)
        for s in live:
            if s.done:
                s.close()
    assert [list(s.out) for s in sess] == refs
    assert all(s.stats.accepted_tokens > 0 for s in sess[1:3])  # chain and tree did speculate


def test_every_other_sequence_of_a_range_is_empty_after_each_tick():
    eng = fake_engine(parallel=3)
    sess = [eng.open_session(req(p, "tree", tree_nodes=12, tree_depth=4)) for p in PROMPTS[:3]]
    tctx = eng.target_ctx
    for _ in range(6):
        eng.tick(sess)
        for s in sess:
            if s.prefilling:
                continue
            base, n = s.slot.target.base, s.slot.target.n_seq_max
            assert tctx.tokens_of(base) == s.tokens[:-1]
            for q in range(base + 1, base + n):
                assert tctx.pos_max(q) == -1
    for s in sess:
        s.close()


def test_tree_at_the_documented_limits_fits_the_slot_range():
    """TREE with 64 nodes and depth 16 (the limits a request may ask for) grows more leaves than a
    slot has sequences: the drafter stops branching when the range is full, it never fails."""
    eng = fake_engine(parallel=2, max_tree_leaves=8)
    s = eng.open_session(req(PROMPTS[0], "tree", max_tokens=60, tree_nodes=64, tree_depth=16))
    s.check_kv = True
    while not s.done:
        eng.tick([s])
        rec = eng.last_tick
        assert rec.verify_tokens <= 65
    s.close()
    assert s.finish_reason in ("length", "eos")


def test_long_prompt_is_prefilled_in_pieces_while_others_decode():
    eng = fake_engine(parallel=2, n_ctx=512)
    a = eng.open_session(req(PROMPTS[0], "plain", max_tokens=300))
    while a.prefilling:
        eng.tick([a])
    long_prompt = [0] + [4 + i % 50 for i in range(400)]
    b = eng.open_session(req(long_prompt, "plain", max_tokens=4))
    pieces = []
    emitted = []
    while b.prefilling:
        before = len(a.out)
        eng.tick([a, b])
        pieces.append(eng.last_tick.prefill_tokens)
        emitted.append(len(a.out) - before)
    assert len(pieces) > 2 and max(pieces) < 400
    assert all(e == 1 for e in emitted)  # the running stream got a token every tick of the prefill
    assert eng.target_ctx.tokens_of(b.slot.target.base) == long_prompt[:-1]
    a.close()
    b.close()


def test_a_prefill_piece_never_crosses_an_n_batch_boundary():
    eng = fake_engine(parallel=1, n_ctx=512)
    s = eng.open_session(req([0] + [5] * 150, "plain", max_tokens=2))
    starts = []
    while s.prefilling:
        starts.append(s.prefill_pos)
        eng.tick([s])
    # alone, each piece is exactly the chunk a one-shot prefill would run (n_batch 64)
    assert starts == [0, 64, 128]
    s.close()


def test_cancelled_mid_prefill_frees_the_slot_and_its_cells():
    eng = fake_engine(parallel=2, n_ctx=512)
    a = eng.open_session(req(PROMPTS[0], "plain", max_tokens=100))
    b = eng.open_session(req([0] + [6] * 300, "plain"))
    for _ in range(3):
        eng.tick([a, b])
    assert b.prefilling
    b.close("cancelled")
    assert b.result().finish_reason == "cancelled" and eng.free_slots == 1
    assert eng.target_ctx.pos_max(b.slot.target.base) == -1  # nothing half-prefilled is kept
    a.close()


def test_utf8_tail_cut_by_max_tokens_is_dropped_from_the_text():
    eng = fake_engine(parallel=1)
    s = eng.open_session(req(PROMPTS[0], "plain", max_tokens=3))
    s.emitter.push([5, 6])
    taken, text = s.emitter.push([2])  # the first byte of a two-byte character, then max_tokens
    assert s.finish_reason == "length" and taken == [2]
    assert "\ufffd" not in s.text and s.text.endswith("fg") and s.out[-1] == 2
    s.close()


def test_utf8_character_split_across_steps_is_sent_whole():
    eng = fake_engine(parallel=1)
    s = eng.open_session(req(PROMPTS[0], "plain", max_tokens=10))
    _, t1 = s.emitter.push([2])
    _, t2 = s.emitter.push([3])
    assert t1 == "" and t2 == "é"
    s.close()


def test_stop_string_and_eos():
    eng = fake_engine(parallel=1)
    s = eng.open_session(GenerationRequest((0, 5), SamplingParams(max_tokens=20, stop=("gh",))))
    _, t1 = s.emitter.push([5, 6])  # "fg": "g" may start the stop string
    assert t1 == "f"
    s.emitter.push([7, 8])
    assert s.finish_reason == "stop" and s.text == "f"
    s.close()
    s = eng.open_session(req(PROMPTS[0], "plain"))
    s.emitter.push([5, EOS, 6])
    assert s.finish_reason == "eos" and s.out == [5]
    s.close()


def test_joint_schedule_keeps_solo_choice_when_alone_and_shrinks_when_verification_is_dear():
    from edgespec.controller.cost import CostModel
    from edgespec.tick.schedule import schedule

    eng = fake_engine(parallel=4)
    sess = [eng.open_session(req(p, "auto", max_tokens=200)) for p in PROMPTS]
    for _ in range(8):
        eng.tick(sess)
    # a flat verification curve (a GPU): nobody shrinks
    eng.cost = CostModel.from_tables({1: 0.010, 8: 0.010, 32: 0.011, 128: 0.012},
                                     {1: 0.001, 8: 0.0011, 32: 0.0012})
    solo = {s: s.choose_shape() for s in sess}
    plan = schedule(eng, sess)
    assert all(plan.shapes[s].nodes == solo[s].nodes for s in sess)
    for s in sess:
        s._step, s._consistent = None, True
    # verification linear in its tokens (a CPU under load): the batch speculates less
    eng.cost = CostModel.from_tables({1: 0.010, 8: 0.080, 32: 0.320, 128: 1.28},
                                     {1: 0.001, 8: 0.0011, 32: 0.0012})
    solo = {s: s.choose_shape() for s in sess}
    plan = schedule(eng, sess)
    assert sum(plan.shapes[s].nodes for s in sess) < sum(solo[s].nodes for s in sess)
    for s in sess:
        s._step, s._consistent = None, True
        s.close()


@pytest.mark.parametrize("parallel", [1, 3])
def test_sessions_arriving_and_leaving_keep_every_range_consistent(parallel):
    eng = fake_engine(parallel=parallel)
    todo = list(PROMPTS) * 2
    active, done = [], 0
    while todo or active:
        while todo and eng.free_slots:
            s = eng.open_session(req(todo.pop(), ["chain", "tree", "auto"][len(todo) % 3], max_tokens=12))
            s.check_kv = True
            active.append(s)
        eng.tick(active)
        for s in list(active):
            if s.done:
                s.close()
                active.remove(s)
                done += 1
    assert done == 2 * len(PROMPTS) and eng.free_slots == parallel
