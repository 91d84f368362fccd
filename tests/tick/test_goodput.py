"""The goodput guard in the tick (fake backend): at a level where speculation measured slower
than plain, auto requests decode plainly with no draft forward (explicit modes keep theirs), and
the guard's state reaches the engine's tick totals (Admin.Stats)."""

from __future__ import annotations

from edgespec.controller.goodput import GoodputGuard
from edgespec.sampling import SamplingParams
from edgespec.types import GenerationRequest, SpeculationParams
from tests.fake_backend import fake_backed_engine

KEY = (1, 0)


def fallen_back() -> GoodputGuard:
    g = GoodputGuard(reprobe=10_000, probe_new=False)
    g.key = lambda decoding, host_factor: KEY  # one level whatever the fake's timings
    for _ in range(6):
        g.record(KEY, False, 1, 0.010)  # plain: 100 tokens/s
    for _ in range(6):
        g.record(KEY, True, 2, 0.040)  # speculating: 50 tokens/s
    assert g.levels[KEY].fallback
    return g


def req(mode):
    return GenerationRequest((0, 5, 9, 14), SamplingParams(max_tokens=30), SpeculationParams(mode=mode, ngram=False, suffix=False))


def test_auto_decodes_plainly_where_the_guard_fell_back():
    eng = fake_backed_engine(parallel=1)
    assert eng.generate(req("auto")).stats.draft_forwards > 0  # without the guard it speculates
    eng.goodput = fallen_back()
    res = eng.generate(req("auto"))
    assert res.stats.draft_forwards == 0 and set(res.stats.steps_per_mode) == {"plain"}
    assert eng.goodput.levels[KEY].blocked > 0
    assert eng.tick_totals["goodput_fallback_levels"] == 1.0
    assert "cost_target_host_factor" in eng.tick_totals
    assert eng.generate(req("chain")).stats.draft_forwards > 0  # an explicit mode is the caller's


def test_greedy_output_is_unchanged_by_the_guard():
    ref = fake_backed_engine(parallel=1).generate(req("plain")).token_ids
    eng = fake_backed_engine(parallel=1)
    eng.goodput = fallen_back()
    assert eng.generate(req("auto")).token_ids == ref


def test_a_fallen_back_level_grafts_no_prompt_lookups_either():
    """Prompt lookups are speculation too (their tokens cost verification): where the guard fell
    back, an auto request's steps are bare plain ones."""
    looped = GenerationRequest((0, 5, 9, 14) * 6, SamplingParams(max_tokens=30),
                               SpeculationParams(mode="auto", ngram=True, suffix=False))
    eng = fake_backed_engine(parallel=1)
    assert eng.generate(looped).stats.proposed_by_source.get("prompt_lookup", 0) > 0  # they graft unguarded
    eng.goodput = fallen_back()
    res = eng.generate(looped)
    assert res.stats.proposed_by_source.get("prompt_lookup", 0) == 0 and res.stats.draft_forwards == 0
    assert set(res.stats.steps_per_mode) == {"plain"}


def test_sessions_the_guard_turned_plain_skip_the_controllers_search(monkeypatch):
    """The guard decides before the controllers: a blocked tick spends no time on shape search."""
    from edgespec.controller.controller import Controller
    calls = []
    real = Controller.decide
    monkeypatch.setattr(Controller, "decide", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    eng = fake_backed_engine(parallel=1)
    eng.generate(req("auto"))
    assert calls  # unguarded, every step asks
    calls.clear()
    eng.goodput = fallen_back()
    eng.generate(req("auto"))
    assert not calls


def test_a_tick_whose_drafter_first_reads_a_long_backlog_is_not_scored(monkeypatch):
    """The draft's catch-up on a request's prompt (or on what was decoded while the guard held the
    level plain) is a one-off debt: the guard scores the ticks after it, not that tick, so a probe
    is not sunk by the fallback's own backlog."""
    import edgespec.tick as tick_pkg

    eng = fake_backed_engine(parallel=1)
    catchups, scored = [], []
    real_schedule, real_record = tick_pkg.schedule, eng.goodput.record

    def schedule(engine, sessions):
        plan = real_schedule(engine, sessions)
        if plan.decoding and not plan.prefilling:
            catchups.append(plan.catchup)
        return plan

    monkeypatch.setattr(tick_pkg, "schedule", schedule)
    eng.goodput.record = lambda key, speculated, *a, **k: (scored.append(speculated), real_record(key, speculated, *a, **k))
    prompt = tuple((7 * i + 3) % 64 for i in range(eng.goodput.max_catchup + 8))  # longer than max_catchup
    eng.generate(GenerationRequest(prompt, SamplingParams(max_tokens=30),
                                   SpeculationParams(mode="auto", ngram=False, suffix=False)))
    long = sum(c > eng.goodput.max_catchup for c in catchups)
    assert long >= 1  # the first speculating tick read the prompt
    assert 0 < len(scored) == len(catchups) - long  # every other prefill-free tick was scored


def test_a_request_that_starts_alone_probes_a_fallen_back_level_at_once():
    """At one stream a level's evidence is the previous request's text: the next request probes
    at once (a few speculating ticks), where a guard that waits out its backoff decodes it all
    plainly; a probe that loses falls back again with the backoff kept."""
    eng = fake_backed_engine(parallel=1)
    eng.goodput = g = fallen_back()
    g.probe_new = True
    # the probe's ticks score as slow as the evidence (50 tokens/s against plain's 100), whatever
    # the host's speed: the fake's wall times would make the verdict the machine's load
    real_record = g.record
    g.record = lambda key, speculated, tokens, seconds, unit=1.0: real_record(
        key, speculated, tokens, 0.020 * tokens if speculated else 0.010 * tokens)
    res = eng.generate(req("auto"))
    assert res.stats.draft_forwards > 0
    lv = g.levels[KEY]
    assert lv.fallbacks == 1 and lv.fallback and lv.probe_left == 0
    assert lv.backoff == min(g.max_reprobe, 2 * 10_000)  # the lost probe doubled the backoff (capped)


def test_the_tick_scores_each_tick_at_its_key_in_its_unit_and_says_whether_it_speculated(monkeypatch):
    """The guard's wiring, through the tick rather than the guard alone: every prefill-free tick is
    recorded at the key of its decoding sessions and the cost model's host factor, in the cost
    model's plain-token unit for that many sessions (a plain forward of n over n), with the tokens
    it emitted, and flagged speculating exactly when a drafter ran for one of its sessions."""
    eng = fake_backed_engine(parallel=2)
    monkeypatch.setattr(eng.cost, "host_factor", lambda kind="target": 4.0)  # load level log2(4) = 2
    calls: list[tuple] = []
    eng.goodput.record = lambda key, speculated, tokens, seconds, unit=1.0: calls.append((key, speculated, tokens, unit))
    unit = {n: eng.cost.verify_seconds(n) / n for n in (1, 2)}
    assert unit[1] != unit[2]  # the premise: a unit of the wrong session count would show

    plain = eng.generate(req("plain"))
    assert {(c[0], c[1], c[3]) for c in calls} == {((1, 2), False, unit[1])}
    assert len(plain.token_ids) - 1 <= sum(c[2] for c in calls) <= len(plain.token_ids)  # the first rides the prefill
    calls.clear()
    chain = eng.generate(req("chain"))
    assert chain.stats.draft_forwards > 0 and {(c[0], c[1], c[3]) for c in calls} == {((1, 2), True, unit[1])}
    calls.clear()
    both = [eng.open_session(req("chain")), eng.open_session(req("plain"))]
    while not all(s.done for s in both):
        eng.tick([s for s in both if not s.done])
    together = [c for c in calls if c[0][0] == 2]
    assert together and all(c[1] and c[3] == unit[2] for c in together)  # one drafted: the tick speculated
    assert {(c[0], c[1], c[3]) for c in calls if c[0][0] == 1} == {((1, 2), False, unit[1])}  # the plain one, alone
    for s in both:
        s.close()
