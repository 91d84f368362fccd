import pytest

from edgespec.controller import CostModel


def test_calibrate_with_fake_measure():
    calls = []

    def measure(kind, n):
        calls.append((kind, n))
        return (0.010 + 0.001 * n) if kind == "target" else 0.002 * n

    m = CostModel()
    assert not m.calibrated
    m.calibrate(measure, sizes=(1, 2, 4, 8))
    assert m.calibrated
    assert sorted(calls) == sorted([(k, n) for k in ("target", "draft") for n in (1, 2, 4, 8)])
    assert m.verify_seconds(4) == pytest.approx(0.014)
    assert m.verify_seconds(3) == pytest.approx(0.013)  # interpolated
    assert m.verify_seconds(16) == pytest.approx(0.026)  # extrapolated linearly
    assert m.draft_seconds(6) == pytest.approx(0.012)
    assert m.verify_seconds(1) == pytest.approx(0.011)


def test_lookups_are_monotone_in_batch():
    m = CostModel.from_tables({1: 0.02, 2: 0.015, 4: 0.03}, {1: 0.01})
    assert m.verify_seconds(2) >= m.verify_seconds(1)
    assert m.verify_seconds(3) >= m.verify_seconds(2)


def test_extra_tokens_never_look_cheaper_than_calibration_says():
    """The online curve is calibration times a level per size; a level measured high at a small
    size (its forwards ran at longer contexts, or in a slow minute) flattens the non-decreasing
    curve above it. Priced on that curve, tokens grafted there would look free; `extra_seconds`
    keeps calibration's difference (times the host factor) as the floor."""
    m = CostModel.from_tables({1: 0.020, 2: 0.022, 4: 0.030, 8: 0.046}, {1: 0.005})
    for _ in range(5):
        m.observe("target", 2, 0.044)  # size 2 timed at twice its calibration
        m.observe("target", 4, 0.030)
        m.observe("target", 8, 0.046)
    assert m.verify_seconds(4) - m.verify_seconds(2) == pytest.approx(0.0)  # the flattened curve
    host = m.host_factor()
    assert m.extra_seconds(2, 2) == pytest.approx((0.030 - 0.022) * host)
    assert m.extra_seconds(4, 4) == pytest.approx(0.016)  # where the curve is right, its own difference
    assert m.extra_seconds(4, 0) == 0.0
    m.ctx.one, m.ctx.each = 1e-6, 1e-6  # at a long context each extra token adds its attention too
    at = m.at(1032)
    assert at.extra_seconds(2, 2) == pytest.approx(m.extra_seconds(2, 2) + 1032 * 2e-6)


def test_online_refinement_moves_estimates():
    m = CostModel.from_tables({1: 0.010, 8: 0.020}, {1: 0.005})
    for _ in range(3):
        m.observe("target", 8, 0.040)
    assert m.verify_seconds(8) == pytest.approx(0.040)  # the size's own median
    assert m.verify_seconds(1) == pytest.approx(0.020)  # not timed: the host's factor (2x)
    for _ in range(60):
        m.observe("draft", 1, 0.008)
    assert m.draft_seconds(1) == pytest.approx(0.008)
    d = m.as_dict()
    assert d["observations"]["draft"] == 60
    assert d["calibrated_target_seconds"] == {"1": 0.01, "8": 0.02}  # beside the online curves
    assert d["online"]["target"]["host_factor"] == 2.0
    with pytest.raises(ValueError):
        m.observe("verifier", 1, 0.1)
    off = CostModel.from_tables({1: 0.010}, {1: 0.005}, alpha=0.0)
    off.observe("target", 1, 0.050)
    assert off.verify_seconds(1) == 0.010


# a tick's forwards as the daemon's look: plain ticks (1 token), speculative (5-9), a few sizes
def _ticks(n_ticks, speed, rng):
    true = {1: 0.010, 2: 0.011, 4: 0.013, 8: 0.018, 16: 0.030}
    for _ in range(n_ticks):
        n = int(rng.choice([1, 1, 5, 7, 9]))
        lo = max(k for k in true if k <= n)
        hi = min((k for k in true if k >= n), default=lo)
        base = true[lo] if lo == hi else true[lo] + (true[hi] - true[lo]) * (n - lo) / (hi - lo)
        yield n, base * speed * float(rng.uniform(0.95, 1.05))


def test_a_step_in_host_speed_is_followed_within_ten_ticks():
    """The host gets 2x slower (another tenant) and later fast again: within N = 10 ticks every
    size used is priced within 15 % of the new speed."""
    import numpy as np

    rng = np.random.default_rng(0)
    m = CostModel.from_tables({1: 0.010, 2: 0.011, 4: 0.013, 8: 0.018, 16: 0.030},
                              {1: 0.003, 4: 0.006, 16: 0.015})
    for n, sec in _ticks(100, 1.0, rng):
        m.observe("target", n, sec)
    assert m.verify_seconds(8) == pytest.approx(0.018, rel=0.1)
    for speed in (2.0, 1.0):
        for n, sec in _ticks(10, speed, rng):
            m.observe("target", n, sec)
        for n in (1, 4, 8, 16):  # 16: never timed here, priced by the host's factor
            want = {1: 0.010, 4: 0.013, 8: 0.018, 16: 0.030}[n] * speed
            assert m.verify_seconds(n) == pytest.approx(want, rel=0.15), (speed, n)
        assert m.host_factor() == pytest.approx(speed, rel=0.1)


def test_a_single_ten_times_slower_forward_is_ignored():
    import numpy as np

    rng = np.random.default_rng(1)
    m = CostModel.from_tables({1: 0.010, 8: 0.018}, {1: 0.003})
    before = {n: m.verify_seconds(n) for n in (1, 8)}
    m.observe("target", 1, 0.100)  # the very first observation: a 10x outlier
    assert {n: m.verify_seconds(n) for n in (1, 8)} == before
    for n, sec in _ticks(40, 1.0, rng):
        m.observe("target", n, sec)
    settled = {n: m.verify_seconds(n) for n in (1, 8)}
    m.observe("target", 8, 10 * settled[8])  # later, one page fault / preempted forward
    m.observe("target", 1, 10 * settled[1])
    for n in (1, 8):
        assert m.verify_seconds(n) == pytest.approx(settled[n], rel=0.05)


def test_calibration_keeps_the_lower_envelope():
    """One slow timing of a small batch (another tenant, page faults) must not inflate it, nor
    (through monotonicity) every larger batch."""
    measured = {("target", 1): 0.030, ("target", 2): 0.012, ("target", 4): 0.015, ("target", 8): 0.025,
                ("draft", 1): 0.005, ("draft", 2): 0.004, ("draft", 4): 0.009, ("draft", 8): 0.014}
    m = CostModel()
    m.calibrate(lambda kind, n: measured[(kind, n)], sizes=(1, 2, 4, 8))
    assert m.verify_seconds(1) == pytest.approx(0.012)
    assert m.verify_seconds(4) == pytest.approx(0.015)
    assert m.draft_seconds(1) == pytest.approx(0.004)
    assert m.draft_seconds(8) == pytest.approx(0.014)


def test_tree_expansions_pay_for_every_output_row():
    """A catch-up of n draft tokens needs one row of logits, a tree expansion of n nodes n rows:
    expand_seconds adds the calibrated per-row cost, and the policy prices EAGLE levels with it."""
    from edgespec.controller import ControllerConfig, ShapePolicy, chain, eagle

    cost = CostModel()
    cost.calibrate(lambda kind, n: 0.010 + 0.001 * n, sizes=(1, 2, 4, 8), draft_row=0.002)
    assert cost.expand_seconds(1) == pytest.approx(cost.draft_seconds(1))
    assert cost.expand_seconds(4) == pytest.approx(cost.draft_seconds(4) + 3 * 0.002)
    assert cost.as_dict()["draft_row_seconds"] == 0.002
    pol = ShapePolicy(ControllerConfig(), max_depth=8, max_nodes=32)
    a = [[0.8, 0.3, 0.3, 0.3]] * 8
    free = CostModel()
    free.calibrate(lambda kind, n: 0.010 + 0.001 * n, sizes=(1, 2, 4, 8), draft_row=0.0)
    _, s_tree = pol.evaluate(eagle(3, 4, 4, 16), a, cost)  # levels 2 and 3 expand 4 nodes each
    _, s_free = pol.evaluate(eagle(3, 4, 4, 16), a, free)
    assert s_tree - s_free == pytest.approx(2 * 3 * 0.002)
    assert pol.evaluate(chain(3), a, cost) == pol.evaluate(chain(3), a, free)  # chains expand 1 node


def test_online_refinement_takes_expansion_rows_off():
    from edgespec.controller import AcceptancePrior, Controller, ControllerConfig
    from edgespec.controller.shapes import StepOutcome, eagle

    cost = CostModel(alpha=1.0)  # the last observation wins: easy to read
    cost.calibrate(lambda kind, n: 0.010, sizes=(1, 2, 4, 8), draft_row=0.002)
    ctl = Controller(ControllerConfig(), cost, AcceptancePrior(), max_depth=4, max_nodes=16)
    # catch-up of 1 (predicted 10 ms) + one expansion of 4 (predicted 10 + 3 * 2 = 16 ms) took 26 ms
    ctl._refine_costs(StepOutcome(eagle(2, 4, 4, 8), (0,), (4,), 2, 0.026, (1, 4), 0.012, 9, 2))
    assert cost.draft_seconds(1) == pytest.approx(0.010)
    assert cost.draft_seconds(4) == pytest.approx(0.010)  # 16 ms share minus 3 rows of 2 ms


# ---- context: attention makes every token dearer at a long context --------------------------

def _true_seconds(n, context, one=2.0e-6, each=0.8e-6):
    """A target whose forward costs the calibrated curve plus what its context adds (the rates
    measured on this CPU for the F32 demo target)."""
    base = 0.010 + 0.002 * (n - 1)
    return base + max(0, context - 32) * (one + each * (n - 1))


def _calibrated():
    m = CostModel.from_tables({n: _true_seconds(n, 32) for n in (1, 2, 4, 8)}, {1: 0.005, 4: 0.008})
    m.calib_context = 32
    return m


def test_context_fit_learns_what_a_long_context_adds():
    m = _calibrated()
    assert m.at(4000) is m  # nothing learnt yet: the curves as calibrated
    for i in range(200):
        n, ctx = (1, 2, 5, 8)[i % 4], 100 + (i * 397) % 7900
        m.observe("target", n, _true_seconds(n, ctx), context=ctx)
    assert m.ctx.one == pytest.approx(2.0e-6, rel=0.05) and m.ctx.each == pytest.approx(0.8e-6, rel=0.05)
    at = m.at(8000)
    for n in (1, 5, 8):
        assert at.verify_seconds(n) == pytest.approx(_true_seconds(n, 8000), rel=0.03)
    assert at.curve("target")(5) == at.verify_seconds(5) and at.draft_seconds(4) == m.draft_seconds(4)
    # the curves still describe the calibration context: long-context forwards did not inflate them
    assert m.verify_seconds(5) == pytest.approx(_true_seconds(5, 32), rel=0.03)
    assert m.at(32) is m and m.at(232).verify_seconds(1) == pytest.approx(_true_seconds(1, 232), rel=0.03)
    assert 150 < m.as_dict()["context"]["observations"] < 200  # the nearer ones refined the curves


def test_context_fit_ignores_forwards_without_a_context_and_stays_non_negative():
    m = _calibrated()
    for _ in range(20):
        m.observe("target", 4, 0.5 * _true_seconds(4, 32), context=3000)  # faster than calibration: noise
    assert m.ctx.one >= 0 and m.ctx.each >= 0
    before = m.ctx.observations
    m.observe("target", 4, 0.02)  # no context given: only the curve learns
    m.observe_step(4, 0.02, (), 0.0)
    assert m.ctx.observations == before


def test_context_fit_is_not_thrown_by_one_slowed_forward():
    m = _calibrated()
    for i in range(40):
        n, ctx = (1, 5)[i % 2], 1000 + 150 * i
        m.observe("target", n, _true_seconds(n, ctx), context=ctx)
    one = m.ctx.one
    m.observe("target", 1, _true_seconds(1, 4000) + 0.200, context=4000)  # a 200 ms hiccup
    assert m.ctx.one < 1.5 * one
    assert m.at(8000).verify_seconds(1) < 1.3 * _true_seconds(1, 8000)


def _tick_seconds(per_session):
    """A tick's true seconds: the weights' cost of all its tokens, and each query attending only
    over its own sequence's cells (ggml skips the masked ones). per_session: [(tokens, context)]."""
    n = sum(k for k, _ in per_session)
    return _true_seconds(n, 32) + sum(max(0, c - 32) * (2.0e-6 + 0.8e-6 * (k - 1)) for k, c in per_session)


def test_a_tick_of_several_sessions_pays_each_ones_own_context_not_their_sum():
    """Eight sessions at 400 tokens each in one forward: the context costs what each sequence's
    400 cost, not what one 3,200-token context would. Learnt from single long requests and from
    batched ticks alike, the fit prices both."""
    import numpy as np

    rng = np.random.default_rng(0)
    m = _calibrated()
    for i in range(300):
        if i % 2:
            n, ctx = (1, 5)[i % 4 // 2], int(rng.integers(600, 8000))
            m.observe("target", n, _true_seconds(n, ctx), context=ctx)
        else:
            s = int(rng.integers(2, 9))
            per = [(int(rng.integers(1, 6)), int(rng.integers(600, 3000))) for _ in range(s)]
            m.observe("target", sum(k for k, _ in per), _tick_seconds(per), context=sum(c for _, c in per),
                      sessions=s)
    assert m.ctx.one == pytest.approx(2.0e-6, rel=0.1) and m.ctx.each == pytest.approx(0.8e-6, rel=0.15)
    plain8 = [(1, 400)] * 8
    at = m.at(3200, sessions=8)
    assert at.verify_seconds(8) == pytest.approx(_tick_seconds(plain8), rel=0.05)
    # priced as one 3,200-token sequence, the same tick would cost far more than it does
    assert m.at(3200).verify_seconds(8) > 1.3 * _tick_seconds(plain8)
    # four more tokens, one per session for four of them
    more = [(2, 400)] * 4 + [(1, 400)] * 4
    assert at.extra_seconds(8, 4) == pytest.approx(_tick_seconds(more) - _tick_seconds(plain8), rel=0.1)


def test_many_short_sequences_refine_the_curves_not_the_context_fit():
    """Eight sessions of 200 tokens hold 1,600 together, but each query reads 200 cells: the
    forward teaches the batch-size curve, net of the fit's small estimate, as a lone 200-token
    request's would."""
    m = _calibrated()
    for _ in range(10):
        m.observe("target", 8, 1.5 * _tick_seconds([(1, 200)] * 8), context=1600, sessions=8)
    assert m.ctx.observations == 0
    assert m.verify_seconds(8) > 1.3 * _true_seconds(8, 32)


def test_flat_curves_for_admin_stats():
    m = CostModel.from_tables({1: 0.010, 8: 0.020}, {1: 0.005})
    for _ in range(5):
        m.observe("target", 1, 0.030)
    f = m.flat()
    assert f["cost_target_host_factor"] == pytest.approx(3.0)
    assert f["cost_target_seconds_1"] == pytest.approx(0.030)
    assert f["cost_target_calibrated_seconds_1"] == 0.010
    assert f["cost_target_seconds_8"] == pytest.approx(0.060)  # the host factor prices it
    assert f["cost_draft_seconds_1"] == 0.005 and f["cost_draft_host_factor"] == 1.0
