"""The verifier's output is distributed exactly as the target's: a statistical test.

Significance: Pearson chi-square goodness of fit (cells expected below 5 pooled), each check
rejects at alpha = 1e-3 (edgespec.selftest.ALPHA). Every check runs 100k trials (speculative
steps) over an 8-token vocabulary, for chain and tree verification and several (p, q) pairs:
q close to p, q far from p, q with zero mass where p has mass, q concentrated where p is small.
Seeds are fixed, so the suite is deterministic.

Beside the verifier, a slow pure-Python reference implementation of single-draft modified
rejection sampling (Leviathan et al. 2023 / Chen et al. 2023) must agree with it trial by trial
and pass the same test. Deliberately broken verifiers (no coin, swapped coin, residual not
renormalised / not clipped / replaced by p) must FAIL the same checks (already at 20k trials):
that is what shows the test has power.

Fast tier: the `far` and `zero_mass` pairs, the broken verifiers, the reference; the other pairs
and cross-checks are marked slow (CI runs them too).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from scipy import stats

import edgespec.verify as verify
from edgespec import selftest
from edgespec.selftest import (
    ALPHA,
    CheckResult,
    chain_builder,
    check_tree_exact,
    chi2_sf,
    chi_square_gof,
    gumbel_top_k,
    rolled,
    run_statistical_checks,
)
from edgespec.tree import DraftTree
from edgespec.verify import VerifyResult, verify_stochastic

TRIALS = 100_000
BROKEN_TRIALS = 20_000


def norm(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / x.sum()


P = norm([0.40, 0.25, 0.15, 0.08, 0.05, 0.04, 0.02, 0.01])
PAIRS = {
    "close": (P, norm(P + 0.02)),
    "far": (P, P[::-1].copy()),
    "zero_mass": (P, norm([0, 0, 1, 1, 1, 1, 1, 1])),  # q has none of p's top 2 tokens (65% of p)
    "concentrated": (P, norm([0.01, 0.01, 0.01, 0.01, 0.02, 0.04, 0.3, 0.6])),
}


# --- the chi-square machinery ----------------------------------------------------------------


@pytest.mark.parametrize("dof", [1, 2, 3, 7, 15, 63, 255, 1000])
@pytest.mark.parametrize("quantile", [1e-9, 0.01, 0.5, 0.999, 1 - 1e-9])
def test_chi2_sf_matches_scipy(dof, quantile):
    x = stats.chi2.ppf(quantile, dof)
    assert chi2_sf(x, dof) == pytest.approx(stats.chi2.sf(x, dof), rel=1e-8, abs=1e-300)


def test_chi2_sf_far_tail_and_edges():
    for x, dof in [(500.0, 10), (2000.0, 255), (1e-6, 4)]:
        assert chi2_sf(x, dof) == pytest.approx(stats.chi2.sf(x, dof), rel=1e-6)
    assert chi2_sf(0.0, 5) == 1.0
    assert chi2_sf(float("inf"), 5) == 0.0
    assert chi2_sf(3.0, 0) == 1.0


def test_gof_matches_scipy_when_no_pooling_is_needed():
    rng = np.random.default_rng(0)
    probs = norm(rng.uniform(0.5, 1.5, size=12))
    counts = rng.multinomial(10_000, probs)
    stat, dof, p_value = chi_square_gof(counts, probs)
    ref = stats.chisquare(counts, probs * counts.sum())
    assert dof == 11
    assert stat == pytest.approx(ref.statistic)
    assert p_value == pytest.approx(ref.pvalue, rel=1e-8)


def test_gof_pools_small_cells():
    probs = np.array([0.5, 0.3, 0.15, 0.03, 0.01, 0.01])  # n=100: expected 50, 30, 15, 3, 1, 1
    counts = np.array([48, 31, 14, 4, 2, 1])
    stat, dof, p_value = chi_square_gof(counts, probs)
    # 3 + 1 + 1 = 5 is one pooled cell: 4 cells, dof 3
    pooled_counts, pooled_exp = np.array([7, 14, 31, 48]), np.array([5.0, 15, 30, 50])
    assert dof == 3
    assert stat == pytest.approx(((pooled_counts - pooled_exp) ** 2 / pooled_exp).sum())
    assert p_value == pytest.approx(stats.chi2.sf(stat, 3))
    # a pool still below 5 absorbs the next smallest cell
    stat, dof, _ = chi_square_gof([1, 1, 10, 88], [0.01, 0.01, 0.1, 0.88])
    assert dof == 1


def test_gof_zero_probability_cell_hit_is_an_outright_failure():
    stat, _, p_value = chi_square_gof([10, 0, 90, 1], [0.1, 0.0, 0.9, 0.0])
    assert stat == float("inf") and p_value == 0.0
    _, dof, p_value = chi_square_gof([10, 0, 90], [0.1, 0.0, 0.9])  # zero cell not hit: dropped
    assert dof == 1 and p_value > 0.05


def test_gumbel_top_k_draws_without_replacement_in_order():
    rng = np.random.default_rng(0)
    q = norm([0.5, 0.2, 0.2, 0.1, 0.0])
    firsts, seconds = np.zeros(5), np.zeros(5)
    n = 20_000
    for _ in range(n):
        xs = gumbel_top_k(q, 3, rng, exclude=(1,))
        assert len(xs) == 3 and len(set(xs)) == 3 and 1 not in xs and 4 not in xs
        firsts[xs[0]] += 1
        seconds[xs[1]] += 1
    q1 = norm([0.5, 0, 0.2, 0.1, 0])  # first draw: q without the excluded token
    np.testing.assert_allclose(firsts / n, q1, atol=0.01)
    # second draw: E over the first of q1 without it
    q2 = sum(q1[a] * norm(np.where(np.arange(5) == a, 0, q1)) for a in (0, 2, 3))
    np.testing.assert_allclose(seconds / n, q2, atol=0.01)
    assert gumbel_top_k(norm([1, 0, 0]), 3, rng) == [0]  # never a zero-mass token


# --- the verifier is exact -------------------------------------------------------------------


def assert_all_pass(results: list[CheckResult]) -> None:
    bad = [(r.name, r.p_value, r.detail) for r in results if not r.passed]
    assert not bad, f"rejected at alpha={ALPHA}: {bad}"


@pytest.mark.parametrize(
    "pair",
    [
        "far",
        "zero_mass",
        pytest.param("close", marks=pytest.mark.slow),
        pytest.param("concentrated", marks=pytest.mark.slow),
    ],
)
def test_chain_and_tree_are_exact(pair):
    p, q = PAIRS[pair]
    results = run_statistical_checks([(pair, p, q)], trials=TRIALS, seed=1)
    assert [r.name for r in results] == [f"{pair}:chain", f"{pair}:tree", f"{pair}:chain_zero_q"]
    assert all(r.detail["trials"] == TRIALS and r.detail["alpha"] == ALPHA for r in results)
    assert_all_pass(results)


def two_level_tree(draft):
    """Branching at both levels: 2 draws without replacement at the root, then a point child and
    2 more draws (excluding it) under each."""

    def build(prefix, rng):
        t = DraftTree.root(prefix[-1] if prefix else 0)
        t.q[0] = draft(prefix)
        kids = [t.add(0, x, point=False) for x in gumbel_top_k(t.q[0], 2, rng)]
        for c in kids:
            ctx = prefix + (t.tokens[c],)
            t.q[c] = draft(ctx)
            guess = (sum(ctx) * 3) % len(t.q[c])
            t.add(c, guess, point=True)
            for x in gumbel_top_k(t.q[c], 2, rng, exclude=(guess,)):
                t.add(c, x, point=False)
        return t

    return build


@pytest.mark.parametrize("pair", ["far", pytest.param("zero_mass", marks=pytest.mark.slow)])
def test_branching_two_level_tree_joint_of_two_tokens_is_exact(pair):
    p, q = PAIRS[pair]
    r = check_tree_exact(
        f"{pair}:tree2", rolled(p), two_level_tree(rolled(q)), n_tokens=2, trials=TRIALS, rng=np.random.default_rng(2)
    )
    assert r.passed, r


def test_point_child_grafted_after_sampled_siblings_is_exact():
    """The n-gram drafter's graft onto a model tree: sampled siblings first (drawn from q without
    replacement), then the n-gram's point token unless a sibling already holds it."""
    draft, target = rolled(PAIRS["far"][1]), rolled(P)

    def build(prefix, rng):
        t = DraftTree.root(prefix[-1] if prefix else 0)
        t.q[0] = draft(prefix)
        for x in gumbel_top_k(t.q[0], 2, rng):
            t.add(0, x, point=False)
        guess = int(np.argmax(target(prefix)))  # an n-gram that often agrees with the target
        if guess not in t.child_tokens(0):
            t.add(0, guess, point=True)
        return t

    r = check_tree_exact("graft", target, build, n_tokens=1, trials=TRIALS, rng=np.random.default_rng(7))
    assert r.passed, r


def test_point_only_chain_is_exact():
    """An n-gram chain: three point children (no draft distribution at all)."""

    target = rolled(P)

    def build(prefix, rng):
        t = DraftTree.root(prefix[-1] if prefix else 0)
        node, ctx = 0, prefix
        for _ in range(3):  # the target's favourite 70% of the time, else a fixed guess
            guess = int(np.argmax(target(ctx))) if rng.random() < 0.7 else len(ctx)
            node = t.add(node, guess, point=True)
            ctx = ctx + (guess,)
        return t

    r = check_tree_exact("ngram", target, build, n_tokens=2, trials=TRIALS, rng=np.random.default_rng(3))
    assert r.passed, r


@pytest.mark.slow
def test_treating_sampled_children_as_point_proposals_is_still_exact():
    """Conditioned on the drafted tokens, any fixed proposals may be verified as point masses:
    exact, just less efficient. (So this is NOT a broken verifier; the p/q coin is what
    makes sampling from q pay.)"""

    def as_point(tree, target_probs, rng):
        return verify_stochastic(dataclasses.replace(tree, point=[True] * len(tree)), target_probs, rng)

    p, q = PAIRS["far"]
    assert_all_pass(run_statistical_checks([("far", p, q)], trials=TRIALS, verifier=as_point, checks=["tree"]))


# --- a slow reference beside it --------------------------------------------------------------


def reference_chain(tree: DraftTree, target_probs, rng: np.random.Generator) -> VerifyResult:
    """Single-draft modified rejection sampling on a chain, in plain Python lists.

    At each drafted token x ~ q: accept with probability min(1, p(x)/q(x)); on rejection emit a
    draw from norm(max(0, p - q)) and stop; after the last drafted token emit a draw from p.
    Uniforms are consumed in the same order as verify_stochastic, so the two agree trial by trial.
    """

    def draw(w: list[float], u: float) -> int:
        acc, cdf = 0.0, []
        for x in w:
            acc += x
            cdf.append(acc)
        target = u * cdf[-1]
        for i, c in enumerate(cdf):
            if c > target:
                return i
        return len(w) - 1

    node, accepted = 0, list[int]()
    while True:
        p = [float(x) for x in target_probs(node)]
        kids = [i for i in range(1, len(tree)) if tree.parents[i] == node]
        assert len(kids) <= 1, "reference handles chains only"
        if not kids:
            token = draw(p, rng.random())
            return VerifyResult(accepted, token, True, [0] * len(accepted), [1] * len(accepted) + [0])
        child = kids[0]
        x = tree.tokens[child]
        q = [float(v == x) for v in range(len(p))] if tree.point[child] else [float(v) for v in tree.q[node]]
        if rng.random() < min(1.0, p[x] / q[x]):
            accepted.append(child)
            node = child
            continue
        r = [max(0.0, a - b) for a, b in zip(p, q, strict=True)]
        s = sum(r)
        r = [v / s for v in r] if s > 1e-12 else p
        token = draw(r, rng.random())
        return VerifyResult(accepted, token, False, [0] * len(accepted), [1] * (len(accepted) + 1))


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_reference_agrees_with_the_verifier_trial_by_trial(pair):
    p, q = PAIRS[pair]
    build = chain_builder(rolled(q), 3)
    target = rolled(p)
    rng = np.random.default_rng(4)
    for _ in range(5_000):
        tree = build((), rng)
        rows = lambda node, tree=tree: target(tuple(tree.tokens[i] for i in tree.path(node)))
        seed = int(rng.integers(2**63))
        want = reference_chain(tree, rows, np.random.default_rng(seed))
        got = verify_stochastic(tree, rows, np.random.default_rng(seed))
        assert got == want


@pytest.mark.parametrize("pair", ["zero_mass", pytest.param("far", marks=pytest.mark.slow)])
def test_reference_is_exact_too(pair):
    p, q = PAIRS[pair]
    r = check_tree_exact(
        f"{pair}:reference",
        rolled(p),
        chain_builder(rolled(q), 2),
        n_tokens=2,
        trials=TRIALS,
        rng=np.random.default_rng(5),
        verifier=reference_chain,
    )
    assert r.passed, r


# --- broken verifiers are caught -------------------------------------------------------------


def _residual_unnormalised(p, q):
    return np.maximum(p - q, 0.0)


def _residual_unclipped(p, q):
    r = p - q
    s = r.sum()
    return r / s if abs(s) > 1e-12 else p


BROKEN = {
    # name: (verify module attribute, replacement, pair, the check that must reject it)
    "accept without the coin": ("accept_prob", lambda p_x, q_x: 1.0, "close", "chain"),
    "coin uses q/p": ("accept_prob", lambda p_x, q_x: 1.0 if q_x >= p_x else q_x / p_x, "close", "tree"),
    "resample from p": ("residual", lambda p, q: p, "far", "chain"),
    "residual not clipped": ("residual", _residual_unclipped, "far", "chain_zero_q"),
    # sample() renormalises, so this only bites where a residual feeds the next sibling's coin
    "residual not renormalised": ("residual", _residual_unnormalised, "far", "tree"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_verifier_is_detected(name, monkeypatch):
    """The same check that passes the real verifier (test_chain_and_tree_are_exact, same seed)
    rejects the broken one, already at a fifth of the trials."""
    attr, fake, pair, check = BROKEN[name]
    monkeypatch.setattr(verify, attr, fake)
    (broken,) = run_statistical_checks([(pair, *PAIRS[pair])], trials=BROKEN_TRIALS, seed=1, checks=[check])
    assert broken.p_value < ALPHA and not broken.passed, f"{name} not detected: {broken}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_verifier_is_detected_by_every_check_that_can_see_it(name, monkeypatch):
    attr, fake, pair, _ = BROKEN[name]
    monkeypatch.setattr(verify, attr, fake)
    results = run_statistical_checks([(pair, *PAIRS[pair])], trials=TRIALS, seed=2)
    caught = {r.name.split(":")[1] for r in results if r.p_value < ALPHA}
    # a residual that is only unnormalised is invisible to a chain (sample() renormalises)
    want = {"tree"} if name == "residual not renormalised" else set(selftest.CHECKS)
    assert caught == want, results


def test_zero_mass_draft_removes_the_targets_top_tokens():
    q0 = selftest.zero_mass_draft(P, PAIRS["far"][1])
    assert q0[:2].sum() == 0 and q0.sum() == pytest.approx(1.0) and (q0[2:] > 0).all()
    # q entirely on those tokens: uniform over the rest
    q0 = selftest.zero_mass_draft(P, norm([1, 1, 0, 0, 0, 0, 0, 0]))
    np.testing.assert_allclose(q0, [0, 0] + [1 / 6] * 6)


def test_joint_probs_is_the_chain_rule():
    target = rolled(P)
    joint = selftest.joint_probs(target, 8, 2)
    assert joint.sum() == pytest.approx(1.0)
    assert joint[3 * 8 + 5] == pytest.approx(P[3] * np.roll(P, 4)[5])


def test_run_statistical_checks_validates_its_input():
    with pytest.raises(ValueError, match="shape"):
        run_statistical_checks([("x", P, P[:4])], trials=10)
    with pytest.raises(ValueError, match="non-negative"):
        run_statistical_checks([("x", P - 0.1, P)], trials=10)
    with pytest.raises(ValueError, match="unknown checks"):
        run_statistical_checks([("x", P, P)], trials=10, checks=["nope"])
    results = run_statistical_checks([("x", P * 3, P)], trials=10)  # unnormalised input is fine
    assert len(results) == len(selftest.CHECKS)
    assert results[0].as_dict().keys() == {"name", "p_value", "passed"}
