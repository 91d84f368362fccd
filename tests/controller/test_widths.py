"""A cost curve that does not grow with n: n tokens priced at the cheapest forward that holds
them, and the width that forward is padded up to (edgespec/controller/widths.py, CostModel.pad_to)."""

import pytest

from edgespec.controller import ControllerConfig, CostModel, ShapePolicy, chain
from edgespec.controller.widths import MMVQ_MAX_TOKENS, WIDTHS, envelope, pad_to, stable_width

# a GPU-like curve: one token a warm CUDA graph, 9..15 tokens past the MMVQ kernel dearer than 16
GPU = {1: 0.0014, 2: 0.0030, 4: 0.0031, 8: 0.0034, 12: 0.0050, 16: 0.0036, 32: 0.0040, 64: 0.0052}


def test_stable_width_rounds_up_into_the_fixed_set() -> None:
    assert [stable_width(n) for n in (1, 2, 3, 5, 8, 9, 17, 64)] == [1, 2, 4, 8, 8, 16, 32, 64]
    assert stable_width(65) == 65  # beyond the widest: itself
    assert stable_width(3, (1, 4, 8)) == 4
    assert MMVQ_MAX_TOKENS in WIDTHS and WIDTHS[WIDTHS.index(MMVQ_MAX_TOKENS) + 1] > MMVQ_MAX_TOKENS
    with pytest.raises(ValueError):
        stable_width(0)


def test_envelope_is_the_minimum_over_larger_sizes() -> None:
    env = envelope(GPU)
    assert env[12] == GPU[16] and env[8] == GPU[8] and env[1] == GPU[1]
    assert all(env[a] <= env[b] for a, b in zip(sorted(env), sorted(env)[1:]))
    assert all(env[n] == min(v for m, v in GPU.items() if m >= n) for n in GPU)


def test_pad_to_picks_the_cheapest_wider_forward_beyond_a_margin() -> None:
    t = GPU.__getitem__
    assert pad_to(12, t, GPU) == 16  # 12 tokens run cheaper as 16
    assert pad_to(8, t, GPU) == 8  # nothing wider is cheaper
    assert pad_to(1, t, GPU) == 1
    # a saving inside the margin (timing noise) does not move the width
    assert pad_to(4, {4: 0.0100, 8: 0.0099}.__getitem__, (4, 8)) == 4
    assert pad_to(4, {4: 0.0100, 8: 0.0080, 16: 0.0080}.__getitem__, (4, 8, 16)) == 8  # the narrower on ties


def test_cost_model_prices_the_envelope_and_reports_the_padded_width() -> None:
    """T(12) > T(16): 12 tokens are priced at T(16) (never the dearer T(12), never less than
    T(16)), and pad_to names 16; a curve that grows with n pads nothing."""
    m = CostModel.from_tables(GPU, {1: 0.0005})
    assert m.verify_seconds(12) == pytest.approx(GPU[16])
    assert m.verify_seconds(10) <= GPU[16] and m.verify_seconds(10) >= GPU[8]
    assert m.pad_to(12) == 16 and m.pad_to(11) == 16
    assert m.pad_to(8) == 8 and m.pad_to(5) == 5
    # a fixed set: always one of its widths, the cheapest that holds n
    assert m.pad_to(5, widths=WIDTHS) == 8 and m.pad_to(9, widths=WIDTHS) == 16
    assert m.pad_to(65, widths=WIDTHS) == 65
    rising = CostModel.from_tables({1: 0.01, 2: 0.011, 4: 0.013, 8: 0.02}, {1: 0.001})
    assert all(rising.pad_to(n) == n for n in range(1, 9))


def test_a_size_measured_dearer_than_a_larger_one_online_is_padded_not_spread() -> None:
    """Calibration said T(8) = T(16); the forwards of 8 then run at twice that. The old running
    maximum priced 16 (and everything above 8) at the slow 8; the envelope keeps 16's own price,
    prices 8 at it, and pads 8 up to 16."""
    m = CostModel.from_tables({1: 0.0014, 4: 0.0030, 8: 0.0035, 16: 0.0035, 32: 0.0040}, {1: 0.0005})
    for _ in range(5):
        m.observe("target", 8, 0.0070)
        m.observe("target", 16, 0.0035)
        m.observe("target", 1, 0.0014)
    assert m.verify_seconds(16) == pytest.approx(0.0035)
    assert m.verify_seconds(8) == pytest.approx(0.0035)
    assert m.pad_to(8) == 16


def test_the_policy_reports_the_padded_width_of_its_choice() -> None:
    cost = CostModel.from_tables(GPU, {1: 0.0001})
    policy = ShapePolicy(ControllerConfig(enable_tree=False, enable_runner_ups=False), max_depth=12, max_nodes=12)
    a = [[0.9] * 4 for _ in range(16)]
    choice = policy.best(a, cost)
    assert choice.shape.mode == "chain"
    assert choice.verify_width == cost.pad_to(choice.shape.verify_tokens)
    # a chain of 11 verifies 12 tokens, priced (and run) as 16
    _, secs = policy.evaluate(chain(11), a, cost)
    assert secs == pytest.approx(0.0001 + 10 * 0.0001 + GPU[16])


def test_a_table_that_dips_learns_each_size_against_its_own_time() -> None:
    """Forwards of 12 tokens that run as the table says leave 12's level at 1: its own time, not
    the envelope's (T(16)) it is priced at, is the yardstick."""
    m = CostModel.from_tables(GPU, {1: 0.0005})
    for _ in range(5):
        m.observe("target", 12, GPU[12])
    assert m.as_dict()["online"]["target"]["level"]["12"] == pytest.approx(1.0)
    assert m.pad_to(12) == 16 and m.verify_seconds(12) == pytest.approx(GPU[16])


# a CPU's repacked Q4_K target (the 1B-cost demo, one thread): 4 tokens take the 4-column gemm,
# 2 and 3 the one-column gemv each
REPACKED = {1: 0.1025, 2: 0.161, 3: 0.186, 4: 0.133, 8: 0.257, 12: 0.359, 16: 0.316}


def test_a_padded_kind_files_each_forward_under_the_width_it_ran_at() -> None:
    """3 tokens run padded as 4 (T(4) < T(3)), so they take T(4). Filed under 3, those times
    would teach size 3 that it costs T(4): pad_to(3) would stop padding and the next forwards of
    3 would run at T(3) (and so on, back and forth). Filed under 4, the decision holds."""
    padded = CostModel.from_tables(REPACKED, {1: 0.015})
    padded.padded.add("target")
    unfiled = CostModel.from_tables(REPACKED, {1: 0.015})
    for m in (padded, unfiled):
        assert m.pad_to(3) == 4 and m.pad_to(2) == 4 and m.pad_to(12) == 16 and m.pad_to(5) == 5
        assert m.verify_seconds(3) == pytest.approx(REPACKED[4])
        for _ in range(10):
            m.observe("target", 1, REPACKED[1])  # plain steps and 4-token ones, as calibrated
            m.observe("target", 4, REPACKED[4])
            m.observe("target", 3, REPACKED[4])  # the padded forward's time
    assert padded.pad_to(3) == 4 and padded.as_dict()["online"]["target"]["level"]["3"] == pytest.approx(1.0)
    assert unfiled.pad_to(3) == 3  # the flip the filing prevents


# the 1B-cost demo's target on one core (cost_curve --threads 1), every size to 16 and beyond:
# ggml's kernels take 4, 8 or 16 tokens at a time, so T(16) < T(12) and T(32) ~ T(28)
JAGGED_CPU = {1: 0.0789, 2: 0.1233, 3: 0.1529, 4: 0.1100, 5: 0.1582, 6: 0.1858, 7: 0.2115, 8: 0.2012,
              9: 0.2324, 10: 0.2580, 11: 0.2840, 12: 0.2844, 13: 0.3073, 14: 0.3386, 15: 0.3686,
              16: 0.2723, 20: 0.3658, 24: 0.4445, 28: 0.5291, 32: 0.5381}


def test_calibration_keeps_each_sizes_own_time_so_dips_pad_from_the_first_forward() -> None:
    """Calibration used to cut its table to the envelope: T(3) became T(4), so `pad_to` saw no
    dip and 3-token verifications ran unpadded at 1.4x T(4) until their own forwards taught the
    online curve. Kept as measured, the dips pad at once; the prices are the envelope's."""
    m = CostModel(alpha=0.0)
    m.calibrate(lambda kind, n: JAGGED_CPU[n], sizes=tuple(JAGGED_CPU), kinds=("target",))
    assert m.pad_to(3) == 4 and m.pad_to(2) == 4 and m.pad_to(7) == 8
    assert all(m.pad_to(n) == 16 for n in range(12, 16))
    assert m.pad_to(1) == 1 and m.pad_to(4) == 4 and m.pad_to(16) == 16
    assert m.verify_seconds(3) == pytest.approx(JAGGED_CPU[4])
    assert m.verify_seconds(13) == pytest.approx(JAGGED_CPU[16])


def test_beyond_the_table_the_curve_keeps_the_last_doublings_slope() -> None:
    """Calibration stopped at 16 on a slow model, where T(16) ~ T(12): extrapolating that last
    segment priced every wider forward (a tick of 8 sessions' chains: 24-40 tokens) at T(16), so
    the joint choice grew trees whose verification then cost twice the price."""
    table = {n: JAGGED_CPU[n] for n in (1, 2, 3, 4, 6, 8, 12, 16)}
    m = CostModel.from_tables(table, {1: 0.012})
    slope = (table[16] - table[8]) / 8
    for n in (20, 24, 32):
        assert m.verify_seconds(n) == pytest.approx(table[16] + slope * (n - 16))
    assert m.verify_seconds(32) > 1.4 * m.verify_seconds(16)
    # a table that keeps rising keeps its last segment's (steeper) slope
    rising = CostModel.from_tables({1: 0.01, 2: 0.011, 4: 0.013, 8: 0.02}, {1: 0.001})
    assert rising.verify_seconds(16) == pytest.approx(0.02 + 8 * (0.02 - 0.013) / 4)


def test_a_jagged_calibration_fills_in_the_sizes_between_its_steps() -> None:
    from edgespec.loading import JAGGED_FILL, fill_sizes

    sparse = {n: JAGGED_CPU[n] for n in (1, 2, 3, 4, 6, 8, 12, 16, 32)}
    fill = fill_sizes(sparse)
    assert fill == [n for n in JAGGED_FILL if n not in sparse]
    assert {5, 7, 9, 11, 13, 15, 20, 24, 28} <= set(fill)
    assert fill_sizes({n: 0.01 + 0.002 * n for n in (1, 2, 3, 4, 6, 8, 12, 16, 32)}) == []
    # noise within JAGGED (5 %) is not a step; only sizes below the largest timed are filled
    assert fill_sizes({1: 0.0100, 2: 0.0104, 4: 0.0102, 8: 0.0150}) == []
    assert fill_sizes({1: 0.08, 2: 0.12, 4: 0.11, 8: 0.20}) == [3, 5, 6, 7]
