"""The engine tick on a fake backend (scripted bigram logits, a fake unified KV cache): the
phases, the KV commit per sequence range, prefill pieces, emit. Fast; the real models are in
tests/tick/test_batched.py."""

from __future__ import annotations

import pytest

from edgespec.sampling import SamplingParams
from edgespec.types import GenerationRequest, SpeculationParams
from tests.fake_backend import EOS, fake_backed_engine


def req(prompt, mode="auto", max_tokens=40, **spec):
    return GenerationRequest(tuple(prompt), SamplingParams(max_tokens=max_tokens),
                             SpeculationParams(mode=mode, **spec))


PROMPTS = [[0, 5, 9, 14], [0, 7, 7, 7, 21, 30], [0, 11], [0, 40, 41, 42, 43, 44, 45, 46]]


def run_alone(eng, prompt, n):
    return eng.generate(req(prompt, "plain", n)).token_ids


def test_batched_greedy_equals_each_alone_and_one_target_forward_per_tick():
    eng = fake_backed_engine(parallel=4)
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
        if rec.decoding:  # one decode with every tree (small prefill pieces may ride along), then the rest
            assert tctx.decodes[before] == rec.verify_tokens + (rec.prefill_tokens if len(tctx.decodes) == before + 1
                                                                 else tctx.decodes[before] - rec.verify_tokens)
            assert len(tctx.decodes) - before <= 1 + (rec.sessions - rec.decoding)
        for s in live:
            if s.done:
                s.close()
    assert [list(s.out) for s in sess] == refs
    assert all(s.stats.accepted_tokens > 0 for s in sess[1:3])  # chain and tree did speculate


def test_every_other_sequence_of_a_range_is_empty_after_each_tick():
    eng = fake_backed_engine(parallel=3)
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
    eng = fake_backed_engine(parallel=2, max_tree_leaves=8)
    s = eng.open_session(req(PROMPTS[0], "tree", max_tokens=60, tree_nodes=64, tree_depth=16))
    s.check_kv = True
    while not s.done:
        eng.tick([s])
        rec = eng.last_tick
        assert rec.verify_tokens <= 65
    s.close()
    assert s.finish_reason in ("length", "eos")


def test_long_prompt_is_prefilled_in_pieces_while_others_decode():
    eng = fake_backed_engine(parallel=2, n_ctx=512)
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
    # the forward that read the last piece took b's first step too: its last prompt token is in
    # the cache, and its first token came out
    assert eng.target_ctx.tokens_of(b.slot.target.base) == long_prompt and len(b.out) == 1
    a.close()
    b.close()


def test_a_piece_is_sized_on_its_marginal_cost_beside_the_grafted_verification():
    """Beside decoding streams a piece adds at most prefill_share times the tick's decode work,
    priced as what its tokens add to the forward (not as a forward of its own), and once the
    grafts have set the verification's size: a bigger verification carries a bigger piece."""
    from edgespec.controller.cost import CostModel
    from edgespec.tick.schedule import MIN_PIECE, Plan, pieces

    eng = fake_backed_engine(parallel=2, n_ctx=512)
    # 20 ms a forward plus 1 ms a token: a piece of p tokens adds p ms beside any verification
    eng.cost = CostModel.from_tables({n: 0.020 + 0.001 * n for n in (1, 2, 4, 8, 16, 32, 64, 128)},
                                     {1: 0.005, 8: 0.006}, alpha=0.0)
    b = eng.open_session(req([0] + [5 + i % 40 for i in range(300)], "plain", max_tokens=4))
    share = eng.cfg.prefill_share
    got = {}
    for n_verify in (1, 4, 20):
        plan = Plan(prefilling=[b], context=b.context, sequences=2)
        p = got[n_verify] = len(pieces(eng, plan, n_verify)[0][1])
        curve = eng.cost.at(plan.context, plan.sequences).verify_seconds
        allowed = share * curve(n_verify)
        assert curve(n_verify + p) - curve(n_verify) <= allowed < curve(n_verify + p + 1) - curve(n_verify)
    assert got[1] < got[4] < got[20]
    # the old rule (a piece's own forward within the allowance) gave MIN_PIECE at one stream:
    # 20 ms + 16 ms > 1.5 x 21 ms
    assert got[1] > MIN_PIECE
    b.close()


def test_a_prompts_last_piece_brings_its_first_step_along():
    """The forward that reads a prompt's last piece also reads its last token (and in auto the
    suffix cache's graft on it): the first tokens come from that forward, as from a one-shot
    prefill, with no forward of their own; explicit modes keep their first step's shape."""
    eng = fake_backed_engine(parallel=1, n_ctx=512, suffix_cache=True, prompt_cache=False)
    prompt = [0] + [5 + (7 * i) % 40 for i in range(150)]  # pieces of 64, 64 and 22 (n_batch 64)
    for mode in ("plain", "auto", "tree"):
        s = eng.open_session(req(prompt, mode, max_tokens=24))
        s.check_kv = True
        before = len(eng.target_ctx.decodes)
        while s.prefilling:
            chunk = eng.tick([s])[s]
        assert len(eng.target_ctx.decodes) - before == 3
        if mode == "tree":
            assert chunk.token_ids == () and s.out == []  # its tree comes next tick
        else:
            assert len(chunk.token_ids) >= 1 and list(chunk.token_ids) == s.out
            assert eng.target_ctx.tokens_of(s.slot.target.base) == prompt + s.out[:-1]
        while not s.done:
            eng.tick([s])
        s.close()
    want = eng.generate(req(prompt, "plain", max_tokens=24)).token_ids
    # the same prompt again in auto: the suffix cache has the answer, and the first step grafts it
    s = eng.open_session(req(prompt, "auto", max_tokens=24))
    s.check_kv = True
    while s.prefilling:
        chunk = eng.tick([s])[s]
    assert len(chunk.token_ids) > 1 and s.stats.accepted_by_source.get("suffix", 0) > 0
    while not s.done:
        eng.tick([s])
    assert s.out == want
    s.close()


def test_a_prefill_piece_never_crosses_an_n_batch_boundary():
    eng = fake_backed_engine(parallel=1, n_ctx=512)
    s = eng.open_session(req([0] + [5] * 150, "plain", max_tokens=2))
    starts = []
    while s.prefilling:
        starts.append(s.prefill_pos)
        eng.tick([s])
    # alone, each piece is exactly the chunk a one-shot prefill would run (n_batch 64)
    assert starts == [0, 64, 128]
    s.close()


def test_cancelled_mid_prefill_frees_the_slot_and_its_cells():
    eng = fake_backed_engine(parallel=2, n_ctx=512)
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
    eng = fake_backed_engine(parallel=1)
    s = eng.open_session(req(PROMPTS[0], "plain", max_tokens=3))
    s.emitter.push([5, 6])
    taken, text = s.emitter.push([2])  # the first byte of a two-byte character, then max_tokens
    assert s.finish_reason == "length" and taken == [2]
    assert "\ufffd" not in s.text and s.text.endswith("fg") and s.out[-1] == 2
    s.close()


def test_utf8_character_split_across_steps_is_sent_whole():
    eng = fake_backed_engine(parallel=1)
    s = eng.open_session(req(PROMPTS[0], "plain", max_tokens=10))
    _, t1 = s.emitter.push([2])
    _, t2 = s.emitter.push([3])
    assert t1 == "" and t2 == "é"
    s.close()


def test_stop_string_and_eos():
    eng = fake_backed_engine(parallel=1)
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

    eng = fake_backed_engine(parallel=4)
    def use(cost):  # the engine's and every controller's (the fake's timings teach it nothing real)
        eng.cost = cost
        for s in sess:
            s.controller.cost = cost
            # nor its wall-clock overheads and model bias (a loaded host would make them decide)
            s.controller.spec_bias, s.controller._overhead = 1.0, {"plain": 0.0, "spec": 0.0}

    sess = [eng.open_session(req(p, "auto", max_tokens=200)) for p in PROMPTS]
    use(CostModel.from_tables({1: 0.036, 16: 0.080}, {1: 0.011, 16: 0.064}, alpha=0.0))
    for _ in range(8):
        eng.tick(sess)
    # a flat verification curve (a GPU): nobody shrinks
    use(CostModel.from_tables({1: 0.010, 8: 0.010, 32: 0.011, 128: 0.012},
                              {1: 0.001, 8: 0.0011, 32: 0.0012}))
    solo = {s: s.decide().shape for s in sess}
    plan = schedule(eng, sess)  # begins no step (tick.start does)
    assert all(s.record is None for s in sess)
    assert sum(solo[s].nodes for s in sess) > 0
    assert all(plan.steps[s].shape.nodes == solo[s].nodes for s in sess)
    # verification linear in its tokens (a CPU under load): the batch speculates less
    # (each session alone still gains: 8 tokens cost 1.6 plain ones; four trees are 3x four roots)
    use(CostModel.from_tables({1: 0.010, 8: 0.016, 32: 0.080, 128: 0.32},
                              {1: 0.001, 8: 0.0011, 32: 0.0012}))
    solo = {s: s.decide().shape for s in sess}
    plan = schedule(eng, sess)
    assert sum(solo[s].nodes for s in sess) > 0
    assert sum(plan.steps[s].shape.nodes for s in sess) < sum(solo[s].nodes for s in sess)
    for s in sess:
        s.close()


def test_the_schedule_decides_and_start_commits():
    """schedule() asks the goodput guard and each controller and changes nothing in them (a plan
    computed only to be inspected leaves no trace); start() tells them what was decided."""
    import copy

    from edgespec.controller.goodput import GoodputGuard
    from edgespec.tick.schedule import schedule, start

    eng = fake_backed_engine(parallel=2)
    sess = [eng.open_session(req(p, "auto", max_tokens=200)) for p in PROMPTS[:2]]
    for _ in range(6):  # past the prompts and the plain first steps: the controllers are closed
        eng.tick(sess)
    ctls = [s.controller for s in sess]
    assert all(c is not None and c.state == "closed" for c in ctls)
    for c in ctls:
        c.last_choice = None
    eng.goodput = GoodputGuard()  # the fake's is off; a fresh one lets this tick speculate

    def seen():
        return [(c.last_choice, c.last_shape, c.breaker.below, c.catchup_skips, c._predicted_seconds) for c in ctls]

    before, guard = seen(), copy.deepcopy(eng.goodput.__dict__)
    plan = schedule(eng, sess)
    assert seen() == before and all(s.record is None for s in sess)
    assert eng.goodput.__dict__ == guard and plan.guard_asked
    assert [plan.steps[s].decision.shape for s in sess] == [s.decide().shape for s in sess]
    start(eng, plan)
    assert all(c.last_choice is not None for c in ctls)  # the closed state's choice, committed
    assert plan.guard_key in eng.goodput.levels  # the guard was asked for the tick's level
    for s in sess:
        s.cancel_step()
        s.close()


class _Paced:
    """A real matcher of a grammar allowing any text, its pacing scripted: `waiting` (its bucket
    lacks its next step) as told, and `defer` (it sat a tick out) and `allow` counted."""

    def __init__(self, eng, waiting: bool):
        from edgespec.constraint import Compiler, Vocabulary
        from edgespec.types import ConstraintSpec

        self._m = Compiler(Vocabulary.from_model(eng.target)).matcher(ConstraintSpec("regex", "(.|\\n)*"))
        self.waits, self.deferred, self.allowed = waiting, 0, 0

    def waiting(self) -> bool:
        return self.waits

    def defer(self) -> None:
        self.deferred += 1

    def allow(self, constrained: int) -> None:
        self.allowed += 1
        self._m.allow(constrained)

    def __getattr__(self, name):
        return getattr(self._m, name)


def test_a_grammar_waiting_for_its_share_sits_the_tick_out_unless_alone(monkeypatch):
    """schedule() leaves a session whose grammar waits for its share out of the tick (plan.held,
    no step, its slot kept) and tells it nothing; start() tells it (`defer`). The others decode.
    With no one else to yield to it decodes: pacing never idles the engine."""
    import string

    from edgespec.tick.schedule import schedule, start
    from tests import fake_backend

    monkeypatch.setattr(fake_backend, "FakeModel", fake_backend.piece_model(list(string.printable)[:fake_backend.VOCAB - 2]))
    eng = fake_backend.fake_backed_engine(parallel=2)
    sess = [eng.open_session(req(p, "plain", max_tokens=200)) for p in PROMPTS[:2]]
    for _ in range(3):  # past the prompts
        eng.tick(sess)
    held, other = sess
    held.matcher = paced = _Paced(eng, waiting=True)
    plan = schedule(eng, sess)
    assert plan.decoding == [other] and plan.held == [held] and paced.deferred == 0
    start(eng, plan)
    assert paced.deferred == 1
    other.cancel_step()
    out, emitted = list(held.out), len(other.out)
    for _ in range(3):
        chunks = eng.tick(sess)
        assert chunks[held].token_ids == () and held.out == out  # sat out, its slot kept
    assert len(other.out) == emitted + 3 and paced.deferred == 4 and paced.allowed == 0
    other.close()
    plan = schedule(eng, [held])  # alone: it decodes
    assert plan.decoding == [held] and plan.held == []
    paced.waits = False
    eng.tick([held])
    assert len(held.out) == len(out) + 1 and paced.allowed == 1
    held.close()


@pytest.mark.parametrize("parallel", [1, 3])
def test_sessions_arriving_and_leaving_keep_every_range_consistent(parallel):
    eng = fake_backed_engine(parallel=parallel)
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


def test_logprobs_are_the_same_in_every_mode():
    """Each emitted token's logprob comes from the row that verified it: its parent's, the
    target's distribution at that context whatever the mode."""
    eng = fake_backed_engine(parallel=2)
    out = {}
    for mode in ("plain", "chain", "tree"):
        r = GenerationRequest(tuple(PROMPTS[1]), SamplingParams(max_tokens=30), SpeculationParams(mode=mode),
                              logprobs=3)
        res = eng.generate(r)
        assert len(res.logprobs) == len(res.token_ids)
        assert all(lp.token == t and len(lp.top) == 3 and lp.top[0][0] == t for lp, t in zip(res.logprobs, res.token_ids))
        out[mode] = [(lp.token, round(lp.logprob, 9), tuple(a for a, _ in lp.top)) for lp in res.logprobs]
    assert out["plain"] == out["chain"] == out["tree"]


def test_a_busy_slots_prefill_is_shared_with_another_slot():
    """Two requests with the same long prefix at once: the second shares the first's prefill
    cells (a copy of sequence ids in the unified cache) in whole n_batch chunks, and decodes the
    same text."""
    eng = fake_backed_engine(parallel=2, n_ctx=512)
    doc = [0] + [4 + i % 40 for i in range(200)]
    a = eng.open_session(req(doc + [50, 51], "plain", max_tokens=20))
    while a.prefilling:
        eng.tick([a])
    b = eng.open_session(req(doc + [52], "plain", max_tokens=20))
    assert b.slot is not a.slot and b.stats.cached_prompt_tokens == 192  # 3 chunks of 64
    while not (a.done and b.done):
        eng.tick([s for s in (a, b) if not s.done])
    ref = run_alone(fake_backed_engine(parallel=1, n_ctx=512), doc + [52], 20)
    assert list(b.out) == ref
    a.close()
    b.close()


def test_a_forward_with_prefill_riders_does_not_teach_the_cost_curves():
    """Prefill pieces riding in a verification's forward make it a forward of more tokens than
    its verification's: its time must not be filed as a forward of the verified tokens alone
    (that inflated the small sizes' levels at 8 streams). Pure verifications still teach."""
    eng = fake_backed_engine(parallel=2, n_ctx=512)
    eng.cost.alpha = 0.1
    targets = []
    real = eng.cost.observe
    eng.cost.observe = lambda kind, n, *a, **k: (targets.append(n) if kind == "target" else None,
                                                 real(kind, n, *a, **k))
    a = eng.open_session(req(PROMPTS[0], "plain", max_tokens=300))
    while a.prefilling:
        eng.tick([a])
    b = eng.open_session(req([0] + [4 + i % 50 for i in range(400)], "plain", max_tokens=4))
    mixed = 0
    targets.clear()
    while b.prefilling:
        eng.tick([a, b])
        mixed += eng.last_tick.prefill_tokens > 0 and eng.last_tick.verify_tokens > 0
    assert mixed > 2 and targets == []
    b.close()
    for _ in range(3):
        eng.tick([a])
    assert targets == [1, 1, 1]
    a.close()


def test_prompts_being_read_count_as_streams_in_the_joint_choice():
    """A stream alone speculates where verification is dear (a CPU's K-quant target), but while
    seven prompts are read beside it a longer tick delays each of their first tokens: it decodes
    plainly then. Beside one prompt its chain still pays. (The old rule left a lone decoding
    session to its own choice whatever was waiting, and every tick of the prefill got longer.)"""
    from edgespec.controller.cost import CostModel
    from edgespec.tick.schedule import schedule

    eng = fake_backed_engine(parallel=8, n_ctx=512, suffix_cache=False, draft_noise=1.5)
    # the 1B-cost demo's measured shape, in seconds: 4 tokens cost 1.5 one-token forwards, each
    # token beyond about 25 ms; a draft forward 12 ms
    eng.cost = CostModel.from_tables({1: 0.080, 2: 0.110, 4: 0.115, 8: 0.210, 16: 0.280, 32: 0.540, 64: 1.06},
                                     {1: 0.012, 2: 0.015, 4: 0.017, 8: 0.027, 16: 0.035, 32: 0.069}, alpha=0.0)
    a = eng.open_session(req(PROMPTS[0], "auto", max_tokens=200, ngram=False))
    for _ in range(30):  # past its first steps: the controller has learnt the draft's acceptance
        eng.tick([a])
    assert a.controller.decide().shape.mode != "plain"
    long_prompt = [0] + [4 + i % 50 for i in range(200)]
    modes = {}
    for waiting in (0, 1, 7):
        others = [eng.open_session(req(long_prompt, "plain", max_tokens=4)) for _ in range(waiting)]
        plan = schedule(eng, [a, *others])
        modes[waiting] = plan.steps[a].shape.mode
        for o in others:
            o.close()
    assert modes[0] != "plain" and modes[1] != "plain"
    assert modes[7] == "plain"
    a.close()
