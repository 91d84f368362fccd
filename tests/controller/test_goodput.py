"""The goodput guard on synthetic tick timings: it falls back to plain where speculating ticks
emit fewer tokens per second than plain ones at the same load level, re-probes with a growing
wait, comes back when speculation wins again, and explores plain ticks to stay informed."""

from __future__ import annotations

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
    # re-probes: 4 ticks each, waits 64, 128, 256, 512, 1024, 1024: ~30 speculating ticks in 2000
    assert sum(did) < 0.025 * len(did)
    flat = g.flat()
    assert flat["goodput_fallback_levels"] == 1 and flat[f"goodput_1_0_fallback"] == 1.0
    assert flat["goodput_1_0_plain_tokens_per_second"] == 100.0


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
