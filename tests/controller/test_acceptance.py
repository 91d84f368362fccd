import pytest

from edgespec.controller import AcceptancePrior, AcceptanceWindow, chain, runner_ups
from edgespec.controller.acceptance import Counts, DropDetector, estimate, step_events
from edgespec.controller.shapes import StepOutcome


def outcome(shape, ranks, offered):
    return StepOutcome(shape, tuple(ranks), tuple(offered), len(ranks) + 1, 0.01, (1,), 0.02, shape.nodes + 1, shape.depth)


def test_step_events_from_accepted_path():
    # depth 1: rank 0 accepted; depth 2: ranks 0,1 rejected, rank 2 accepted; depth 3: 3 offered, all rejected
    ev = step_events(outcome(runner_ups(3, 3), [0, 2], [4, 4, 3]), depths=8, ranks=4)
    assert ev == [(0, 0, 1), (1, 0, 0), (1, 1, 0), (1, 2, 1), (2, 0, 0), (2, 1, 0), (2, 2, 0)]
    # a leaf reached: nothing rejected after it
    assert step_events(outcome(chain(2), [0, 0], [1, 1, 0]), 8, 4) == [(0, 0, 1), (1, 0, 1)]
    # clipped to the model's size
    assert step_events(outcome(chain(3), [0, 0], [1, 1, 1]), depths=2, ranks=4) == [(0, 0, 1), (1, 0, 1)]


def test_window_slides_and_decays():
    w = AcceptanceWindow(3, 2, 2)
    for _ in range(5):
        w.add([(0, 0, 1)])
    assert w.counts.trials[0][0] == 3 and w.counts.accepts[0][0] == 3
    w.add([(0, 0, 0)])
    assert w.counts.trials[0][0] == 3 and w.counts.accepts[0][0] == 2
    w.keep_last(1)
    assert w.counts.trials[0][0] == 1 and w.counts.accepts[0][0] == 0
    d = AcceptanceWindow(4, 1, 1, decay=0.5)
    for _ in range(10):
        d.add([(0, 0, 1)])
    assert d.counts.trials[0][0] == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_estimate_blends_prior_and_follows_evidence():
    prior = AcceptancePrior(4, 2).view(4, 2)
    c = Counts(4, 2)
    a0 = estimate(c, prior, 1.0)
    assert a0[0][0] == pytest.approx(0.75)
    c.add([(0, 0, 0)] * 20)  # depth 1 never accepted
    a = estimate(c, prior, 1.0)
    assert a[0][0] < 0.05
    assert a[3][0] < 0.05  # deeper depths follow the request's level through the prior's profile


def test_prior_learns_across_requests():
    p = AcceptancePrior(4, 2, alpha=0.5)

    counts = Counts(4, 2)
    counts.add([(0, 0, 0)] * 16)
    p.update_from_counts(counts)
    assert p.rates[0][0] == pytest.approx(0.375)
    assert p.rates[1][0] == pytest.approx(0.75)  # no evidence there
    assert p.requests == 1


def test_drop_detector():
    d = DropDetector(threshold=4.0, drop=0.5)
    assert [d.update(False, 0.9) for _ in range(3)][-1] == 3  # 3 misses at p0=0.9: alarm
    d = DropDetector(threshold=4.0, drop=0.5)
    assert all(d.update(i % 2 == 0, 0.5) == 0 for i in range(200))  # alternating at p0=0.5: never
    assert DropDetector(threshold=0.0).update(False, 0.99) == 0  # disabled


def test_calib_events_follow_the_first_choices_verification_reached():
    from edgespec.controller.acceptance import calib_events

    # levels 1-3 drafted with p = 0.35, 0.95, 0.5; the first two accepted (rank 0), the third rejected
    assert calib_events((0.35, 0.95, 0.5), (0, 0)) == [(3, 1), (9, 1), (5, 0)]
    # a runner-up (rank 1) accepted at depth 1: the first choice there failed, deeper ones untried
    assert calib_events((0.35, 0.95, 0.5), (1, 0)) == [(3, 0)]
    # nothing accepted: only level 1 was tried; p = 1.0 falls in the top bucket
    assert calib_events((1.0, 0.9), ()) == [(9, 0)]
    assert calib_events((), (0, 0)) == []


def test_calibration_learns_that_an_unsure_draft_is_right():
    """An 8-bit copy of the target: the draft gives its choice p = 0.3-0.4 yet the target agrees
    97 % of the time. The estimate for that bucket moves from the prior (0.35) to the truth; buckets
    without evidence keep the prior."""
    from edgespec.controller.acceptance import Calibration

    prior = AcceptancePrior().calib
    cal = Calibration(list(prior), weight=1.0)
    assert cal.rates() == tuple(prior)
    assert abs(prior[3] - 0.35) < 1e-9
    cal.add([(3, 1)] * 97 + [(3, 0)] * 3)
    r = cal.rates()
    assert 0.95 < r[3] < 0.975
    assert r[:3] == tuple(prior[:3]) and r[4:] == tuple(prior[4:])
    # and across requests: the prior follows (EWMA) and stays within (0.01, 0.99)
    p = AcceptancePrior()
    p.update_calibration(cal)
    assert prior[3] < p.calib[3] < r[3]
    assert p.as_dict()["calibration"][3] == round(p.calib[3], 4)
