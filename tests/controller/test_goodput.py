"""The goodput guard on synthetic tick timings: it falls back to plain where speculating ticks
emit fewer tokens per second than plain ones at the same load level, re-probes with a growing
wait, comes back when speculation wins again, and explores plain ticks to stay informed."""

from __future__ import annotations

import pytest

from edgespec.controller.goodput import GoodputGuard

KEY = GoodputGuard.key(1, 1.0)


def drive(g: GoodputGuard, ticks: int, spec_rate: float, plain_rate: float, key=KEY, wants=True) -> list[bool]:
    """Ticks where the sessions want to speculate (wants) or decode plainly: the guard decides,
    the tick emits at the rate of what it did. Returns what each tick did (True: speculated)."""
    did = []
    for _ in range(ticks):
        spec = wants and g.allow(key)
        rate = spec_rate if spec else plain_rate
        tokens = 3 if spec else 1
        g.record(key, spec, tokens, tokens / rate)
        did.append(spec)
    return did


def test_losing_speculation_falls_back_and_reprobes_rarely():
    g = GoodputGuard()
    drive(g, 6, 0, 100.0, wants=False)  # a few plain ticks (the first token, an open breaker)
    did = drive(g, 2000, spec_rate=80.0, plain_rate=100.0)
    assert g.levels[KEY].fallback
    assert sum(did[:10]) <= g.min_ticks + 1  # it fell back within a few ticks
    # re-probes: a few ticks each, waits 64, 128, 256, 512, 1024: ~40 speculating ticks in 2000
    assert sum(did) < 0.025 * len(did)
    flat = g.flat()
    assert flat["goodput_fallback_levels"] == 1 and flat["goodput_1_0_fallback"] == 1.0
    assert flat["goodput_1_0_plain_score"] == pytest.approx(100.0)


def test_speculation_that_wins_is_left_alone_and_comes_back_after_a_fallback():
    g = GoodputGuard()
    drive(g, 6, 0, 100.0, wants=False)
    did = drive(g, 500, spec_rate=150.0, plain_rate=100.0)
    assert not g.levels[KEY].fallback
    assert sum(did) > 0.95 * len(did)  # exploration: a plain tick now and then while it is stale
    drive(g, 200, spec_rate=70.0, plain_rate=100.0)  # the text changes: the draft stops agreeing
    assert g.levels[KEY].fallback
    did = drive(g, 300, spec_rate=150.0, plain_rate=100.0)  # and agrees again: the next probe sees it
    assert not g.levels[KEY].fallback and sum(did[-100:]) > 90


def test_a_new_request_alone_probes_at_once_and_a_lost_probe_still_backs_off():
    g = GoodputGuard()
    drive(g, 6, 0, 100.0, wants=False)
    drive(g, 40, spec_rate=60.0, plain_rate=100.0)
    lv = g.levels[KEY]
    assert lv.fallback and not g.allow(KEY)  # held plain, waiting out its backoff
    backoff = lv.backoff
    g.new_request(KEY)
    did = drive(g, g.probe, spec_rate=60.0, plain_rate=100.0)
    assert all(did) and lv.fallback and lv.backoff == 2 * backoff
    GoodputGuard.new_request(g, GoodputGuard.key(2, 1.0))  # a level never seen: nothing happens


def test_levels_are_separate():
    """A busy host (host factor 2) or more sessions is another level: a loss at one does not
    stop speculation at another."""
    g = GoodputGuard()
    busy = GoodputGuard.key(4, 2.0)
    assert busy != KEY and GoodputGuard.key(4, 2.1) == busy
    drive(g, 6, 0, 100.0, key=busy, wants=False)
    drive(g, 100, spec_rate=50.0, plain_rate=100.0, key=busy)
    assert g.levels[busy].fallback
    assert g.allow(KEY)


def test_a_disabled_guard_always_allows():
    g = GoodputGuard(enabled=False)
    assert all(drive(g, 100, spec_rate=1.0, plain_rate=100.0))


def drive_mixed(g: GoodputGuard, ticks: int, gain: float, seed: int = 0, sessions=(5, 6, 7, 8),
                host=lambda t: 1.0, t0: int = 0) -> list[bool]:
    """Ticks at a decoding count that moves (requests end, prompts prefill) on a host whose speed
    changes: a plain token costs `unit` seconds at n sessions (a CPU verify curve, 1 ms per token
    plus 4 ms a forward, times the host's slowness, which the online cost model follows);
    speculating emits `gain` times plain's tokens per second. Returns what each tick did."""
    import random

    rng = random.Random(seed)
    did = []
    for t in range(t0, t0 + ticks):
        n = rng.choice(sessions)
        unit = host(t) * (0.004 + 0.001 * n) / n
        key = g.key(n, host(t))
        spec = g.allow(key)
        plain_secs = n * unit * rng.uniform(0.95, 1.05)
        tokens = 3 * n if spec else n
        secs = tokens * plain_secs / n / gain if spec else plain_secs
        g.record(key, spec, tokens, secs, unit)
        did.append(spec)
    return did


def test_a_moving_session_count_still_gets_judged(cls=GoodputGuard):
    """At 8 streams the decoding count moves between 5 and 8 from tick to tick: all of it is one
    level, and a loss of 10 % falls back within a few dozen ticks of a fresh process."""
    g = cls()
    did = drive_mixed(g, 60, gain=0.90)
    assert g.levels[g.key(8, 1.0)].fallback
    assert sum(did) < 30
    assert g.key(5, 1.0) == g.key(8, 1.0) != g.key(4, 1.0)


def test_plain_ticks_at_another_session_count_are_the_reference(cls=GoodputGuard):
    """Scored in plain-token units, plain ticks at one stream judge speculation at eight: the
    eight-stream level falls back on its own speculating ticks alone, and one that wins stays."""
    for gain, falls in ((0.85, True), (1.3, False)):
        g = cls()
        drive_mixed(g, 8, gain=1.0, sessions=(1,))
        for _ in range(8):  # plain only at one stream
            g.record(g.key(1, 1.0), False, 1, 0.005, 0.005)
        drive_mixed(g, 12, gain=gain, sessions=(8,))
        lv = g.levels[g.key(8, 1.0)]
        assert lv.fallback is falls
        if not falls:
            assert not lv.plain  # judged with no plain tick of its own


def test_a_host_that_slows_down_is_not_a_loss(cls=GoodputGuard):
    """The host runs 40 % slower for the speculating ticks after plain was measured fast: the
    cost model's unit follows the host, so a speculation that still wins 30 % is left alone, and
    one that loses 10 % still falls back."""
    slow = lambda t: 1.0 if t < 40 else 1.4  # not a factor-of-2 step: the same level
    for gain, falls in ((1.3, False), (0.9, True)):
        g = cls()
        drive_mixed(g, 40, gain=1.0, sessions=(4,), host=slow)
        drive_mixed(g, 200, gain=gain, sessions=(4,), host=slow, t0=40)
        lv = g.levels[g.key(4, 1.0)]
        assert lv.fallback is falls and lv.fallbacks == int(falls)  # a win never fell back at all


def test_a_fresh_process_explores_plain_early(cls=GoodputGuard):
    """No plain evidence yet: one tick in explore_first is plain until min_ticks are in, then one
    in explore while the reference is fresh enough (here: never stale)."""
    g = cls()
    did = drive_mixed(g, 400, gain=2.0, sessions=(2,))
    assert did[:4] == [True] * 4 and not did[4]
    plain_first = [i for i, d in enumerate(did) if not d][:4]
    assert plain_first[-1] < 4 * (g.explore_first + 1)
    assert sum(did) > 0.97 * len(did)


def drive_scattered(g: GoodputGuard, ticks: int, gain: float, seed: int = 0) -> list[bool]:
    """One stream, plain ticks 1 token in 20 ms; a speculating tick emits 1, 2, 3 or 5 tokens
    (p .4, .2, .2, .2: 2.4 on average, what a draft that is often right but not always gives) in
    a fixed time, set so that speculation makes `gain` times plain's tokens per second."""
    import random

    rng = random.Random(seed)
    did = []
    for _ in range(ticks):
        spec = g.allow(KEY)
        if spec:
            tokens = rng.choices((1, 2, 3, 5), (0.4, 0.2, 0.2, 0.2))[0]
            secs = 2.4 * 0.020 / gain * rng.uniform(0.97, 1.03)
        else:
            tokens, secs = 1, 0.020 * rng.uniform(0.97, 1.03)
        g.record(KEY, spec, tokens, secs, 0.020)
        did.append(spec)
    return did


def test_speculation_that_wins_on_average_is_not_dropped_for_an_unlucky_run(cls=GoodputGuard):
    """Speculating ticks scatter (1 to 5 tokens a tick): a 25 % average gain stays speculating
    over 3,000 ticks, where a guard judging the bare window means spent most of them plain;
    a 40 % loss with the same scatter still falls back."""
    g = cls()
    did = drive_scattered(g, 3000, gain=1.25)
    assert g.levels[KEY].fallbacks <= 2 and sum(did) > 0.9 * len(did)
    g = cls()
    did = drive_scattered(g, 3000, gain=0.6)
    assert g.levels[KEY].fallback and sum(did) < 0.1 * len(did)


class RawRate(GoodputGuard):
    """Broken twin: scores raw tokens per second (the cost model's unit ignored)."""

    def record(self, key, speculated, tokens, seconds, unit=1.0):
        super().record(key, speculated, tokens, seconds, 1.0)


class ExactCount(GoodputGuard):
    """Broken twin: a level per exact session count, judged by its own plain ticks only."""

    @staticmethod
    def key(decoding, host_factor):
        return (decoding, GoodputGuard.key(1, host_factor)[1])

    def _plain_ref(self, key, lv):
        fresh = len(lv.plain) >= self.min_ticks and self.ticks - lv.plain_at < self.stale
        return lv.plain if fresh else None


class LateExplorer(GoodputGuard):
    """Broken twin: a fresh process explores plain only one tick in `explore`."""

    def __init__(self):
        super().__init__(explore_first=32)


class BareMeans(GoodputGuard):
    """Broken twin: the window means alone decide (no evidence test), as the guard first did."""

    def __init__(self):
        super().__init__(z=0.0, window=16)


@pytest.mark.parametrize(("twin", "scenario"), [
    (BareMeans, test_speculation_that_wins_on_average_is_not_dropped_for_an_unlucky_run),
    (RawRate, test_plain_ticks_at_another_session_count_are_the_reference),
    (RawRate, test_a_host_that_slows_down_is_not_a_loss),
    (ExactCount, test_a_moving_session_count_still_gets_judged),
    (ExactCount, test_plain_ticks_at_another_session_count_are_the_reference),
    (LateExplorer, test_a_fresh_process_explores_plain_early),
    (LateExplorer, test_a_moving_session_count_still_gets_judged),
])
def test_the_scenarios_reject_broken_guards(twin, scenario):
    with pytest.raises(AssertionError):
        scenario(twin)


def test_allows_foretells_allow_and_changes_nothing():
    """The tick's schedule asks `allows` (changing nothing), its start then tells `new_request`
    and asks `allow`: the two answers agree through fallbacks, probes, a request starting alone
    and plain exploration, at several levels."""
    import copy
    import random

    rng = random.Random(0)
    for g in (GoodputGuard(), GoodputGuard(explore=4, reprobe=8, max_reprobe=32), GoodputGuard(enabled=False)):
        answers = set()
        for t in range(1500):
            key = GoodputGuard.key(rng.choice([1, 1, 2, 4]), 1.0)
            new = rng.random() < 0.05
            before = copy.deepcopy(g.__dict__)
            said = g.allows(key, new)
            assert g.__dict__ == before
            if new:
                g.new_request(key)
            got = g.allow(key)
            assert said == got, (t, key, new)
            answers.add(got)
            rate = (80.0 if t < 800 else 120.0) if got else 100.0  # speculation loses, then wins
            g.record(key, got, 3 if got else 1, (3 if got else 1) / rate)
        assert answers == ({True, False} if g.enabled else {True})
