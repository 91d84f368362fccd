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


def test_ewma_refinement_moves_estimates():
    m = CostModel.from_tables({1: 0.010, 8: 0.020}, {1: 0.005}, alpha=0.5)
    before = m.verify_seconds(8)
    m.observe("target", 8, 0.040)
    assert m.verify_seconds(8) == pytest.approx(before + 0.5 * (0.040 - before))
    # between calibrated sizes the correction is spread over both neighbours
    mid = m.verify_seconds(4)
    m.observe("target", 4, mid * 2)
    assert m.verify_seconds(4) > mid
    # repeated observations converge
    for _ in range(60):
        m.observe("draft", 1, 0.008)
    assert m.draft_seconds(1) == pytest.approx(0.008, rel=1e-3)
    assert m.as_dict()["observations"]["draft"] == 60
    with pytest.raises(ValueError):
        m.observe("verifier", 1, 0.1)


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
