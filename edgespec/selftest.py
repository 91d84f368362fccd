"""Statistical exactness checks for the verifier: the pure-numpy core of `edgespec selftest`.

Exact speculative decoding promises that the tokens it emits are distributed exactly as the
target's (after its sampling transforms), whatever the draft proposes. These checks sample the
verifier many times on small vocabularies and test that promise with a chi-square
goodness-of-fit test:

    H0: the emitted tokens ~ target distribution.   Reject when p_value < alpha (default 1e-3).

Cells whose expected count is below 5 are pooled into one cell (if that pooled cell is still
below 5 it is merged with the smallest remaining cells). A token emitted where the target has
zero mass is an outright failure (p_value = 0). With `alpha = 1e-3` per check, a correct
verifier fails a given check with probability 1e-3: a run of n checks raises a false alarm with
probability about n * 1e-3 (rerun with another `seed` before suspecting the verifier). The
broken verifiers in tests/test_verify_stats.py are rejected with p_values far below 1e-3
already at 20k trials (the default is 100k). Power depends on the distributions: a very peaked
target (one token near probability 1) leaves few cells and little to detect.

The target and the draft are context dependent, as in a real model: after an emitted prefix
x_1..x_m both are the given p and q rolled (`np.roll`) by h = sum(x_i + 1); h = 0 for the
first token. A verifier that mixes up levels of the tree is therefore caught too.

Per (name, p, q) pair, `run_statistical_checks` runs:
  - `chain`: a chain of 2 drafted tokens, each drawn from the draft after its prefix; tests the
    joint distribution of the first TWO emitted tokens (V^2 cells) against
    p(x_1) * p_rolled(x_2 | x_1). When a step emits a single token, the next step (a fresh chain
    from the new context) supplies the second one.
  - `tree`: one point (n-gram-like) child first, whose token is a fixed function of the
    context, then 3 siblings drawn from q WITHOUT replacement excluding the point token
    (Gumbel-top-k), each with one drafted grandchild; tests the first emitted token (V cells).
  - `chain_zero_q`: as `chain` with a draft q0 that has ZERO mass on the target's top
    ceil(V/4) tokens (q restricted to the other tokens, renormalised; uniform there if q has no
    mass left); those tokens can only come from the residual.

Pure numpy: scipy is a dev extra only, so the chi-square tail is computed here (regularised
upper incomplete gamma, Numerical Recipes' series / continued fraction).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from edgespec.tree import DraftTree
from edgespec.verify import VerifyResult, verify_stochastic

ALPHA = 1e-3  # per-check significance level
MIN_EXPECTED = 5.0  # cells expected below this are pooled
TREE_SAMPLED_SIBLINGS = 3
CHECKS = ("chain", "tree", "chain_zero_q")

Target = Callable[[tuple[int, ...]], np.ndarray]  # emitted prefix -> [V] target dist. after it
Builder = Callable[[tuple[int, ...], np.random.Generator], DraftTree]  # prefix -> draft tree
Verifier = Callable[[DraftTree, Callable[[int], np.ndarray], np.random.Generator], VerifyResult]


@dataclass(frozen=True)
class CheckResult:
    name: str
    p_value: float
    passed: bool
    detail: dict = field(default_factory=dict)  # stat, dof, trials, cells, alpha, tv

    def as_dict(self) -> dict:
        return {"name": self.name, "p_value": self.p_value, "passed": self.passed}


# --- chi-square ------------------------------------------------------------------------------

_GAMMA_EPS = 1e-15
_GAMMA_FPMIN = 1e-300
_GAMMA_ITMAX = 10_000


def _gamma_p_series(a: float, x: float) -> float:
    """Regularised lower incomplete gamma P(a, x) by its series (good for x < a + 1)."""
    ap, term = a, 1.0 / a
    total = term
    for _ in range(_GAMMA_ITMAX):
        ap += 1.0
        term *= x / ap
        total += term
        if abs(term) < abs(total) * _GAMMA_EPS:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _gamma_q_fraction(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x) by its continued fraction (x >= a + 1), Lentz."""
    b = x + 1.0 - a
    c = 1.0 / _GAMMA_FPMIN
    d = 1.0 / b
    h = d
    for i in range(1, _GAMMA_ITMAX):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        if abs(d) < _GAMMA_FPMIN:
            d = _GAMMA_FPMIN
        c = b + an / c
        if abs(c) < _GAMMA_FPMIN:
            c = _GAMMA_FPMIN
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _GAMMA_EPS:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def gamma_q(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a), a > 0, x >= 0."""
    if a <= 0:
        raise ValueError(f"a must be > 0, got {a}")
    if x <= 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    if x < a + 1.0:
        return max(0.0, 1.0 - _gamma_p_series(a, x))
    return _gamma_q_fraction(a, x)


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square with `dof` degrees of freedom."""
    if dof <= 0:
        return 1.0
    return gamma_q(dof / 2.0, stat / 2.0)


def chi_square_gof(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """Pearson chi-square goodness of fit of `counts` ([cells] ints) to `probs` ([cells]).

    Returns (stat, dof, p_value). Cells expected below MIN_EXPECTED are pooled; any count in a
    zero-probability cell gives (inf, dof, 0.0).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if counts.shape != probs.shape:
        raise ValueError(f"counts {counts.shape} and probs {probs.shape} differ in shape")
    if np.any(probs < 0) or not np.isfinite(probs).all() or probs.sum() <= 0:
        raise ValueError("probs must be finite, non-negative, with positive sum")
    n = counts.sum()
    probs = probs / probs.sum()
    impossible = (probs == 0) & (counts > 0)
    live = probs > 0
    counts, expected = counts[live], probs[live] * n
    order = np.argsort(expected, kind="stable")
    counts, expected = counts[order], expected[order]
    small = int(np.count_nonzero(expected < MIN_EXPECTED))
    # pool the small cells, then keep absorbing the next smallest until the pool reaches the floor
    while small < len(expected) and 0 < expected[:small].sum() < MIN_EXPECTED:
        small += 1
    if small > 0:
        counts = np.concatenate([[counts[:small].sum()], counts[small:]])
        expected = np.concatenate([[expected[:small].sum()], expected[small:]])
    dof = len(expected) - 1
    if impossible.any():
        return math.inf, dof, 0.0
    if n == 0 or dof <= 0:
        return 0.0, max(dof, 0), 1.0
    stat = float(((counts - expected) ** 2 / expected).sum())
    return stat, dof, chi2_sf(stat, dof)


# --- the generic check -----------------------------------------------------------------------


def check_tree_exact(
    name: str,
    target: Target,
    build_tree: Builder,
    *,
    n_tokens: int = 1,
    trials: int = 100_000,
    rng: np.random.Generator,
    alpha: float = ALPHA,
    verifier: Verifier = verify_stochastic,
) -> CheckResult:
    """Run `trials` speculative steps and test the first `n_tokens` emitted tokens against the
    target's joint distribution.

    target(prefix) is the target distribution after the emitted `prefix` (same vocabulary size V
    for every prefix). build_tree(prefix, rng) drafts a tree whose root is the last emitted token;
    node i's target distribution is target(prefix + tokens on the path to i). When a step emits
    fewer than n_tokens, further steps (new trees from the longer prefix) follow.
    """
    if n_tokens < 1 or trials < 1:
        raise ValueError("n_tokens and trials must be >= 1")
    rows: dict[tuple[int, ...], np.ndarray] = {}

    def row(prefix: tuple[int, ...]) -> np.ndarray:
        r = rows.get(prefix)
        if r is None:
            r = rows[prefix] = _as_probs(target(prefix), f"target{prefix}")
        return r

    v = len(row(()))
    counts = np.zeros(v**n_tokens, dtype=np.int64)
    for _ in range(trials):
        out: list[int] = []
        while len(out) < n_tokens:
            prefix = tuple(out)
            tree = build_tree(prefix, rng)
            res = verifier(tree, _path_rows(tree, prefix, row), rng)
            out.extend(tree.tokens[i] for i in res.accepted)
            out.append(int(res.token))
        idx = 0
        for t in out[:n_tokens]:
            idx = idx * v + t
        counts[idx] += 1
    expected = joint_probs(row, v, n_tokens)
    stat, dof, p_value = chi_square_gof(counts, expected)
    tv = 0.5 * float(np.abs(counts / trials - expected).sum())
    detail = {"stat": stat, "dof": dof, "trials": trials, "cells": int(counts.size), "alpha": alpha, "tv": tv}
    return CheckResult(name, float(p_value), bool(p_value >= alpha), detail)


def _path_rows(
    tree: DraftTree, prefix: tuple[int, ...], row: Callable[[tuple[int, ...]], np.ndarray]
) -> Callable[[int], np.ndarray]:
    def target_probs(node: int) -> np.ndarray:
        return row(prefix + tuple(tree.tokens[i] for i in tree.path(node)))

    return target_probs


def joint_probs(row: Callable[[tuple[int, ...]], np.ndarray], v: int, n_tokens: int) -> np.ndarray:
    """[v ** n_tokens] P(x_1..x_n) = prod_m row(x_1..x_{m-1})[x_m], in row-major cell order."""
    out = np.empty(v**n_tokens)
    for idx, seq in enumerate(itertools.product(range(v), repeat=n_tokens)):
        p = 1.0
        for m in range(n_tokens):
            p *= row(seq[:m])[seq[m]]
            if p == 0.0:
                break
        out[idx] = p
    return out


# --- drafting helpers (what the drafters do, in miniature) ------------------------------------


def _as_probs(x: np.ndarray, what: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or len(x) < 2:
        raise ValueError(f"{what}: must be a 1-D distribution over >= 2 tokens, got shape {x.shape}")
    if not np.isfinite(x).all() or np.any(x < 0) or x.sum() <= 0:
        raise ValueError(f"{what}: must be finite, non-negative, with positive sum")
    return x / x.sum()


def draw(q: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from q (inverse CDF, as edgespec.sampling.sample; never a zero-mass token)."""
    c = _cdf(q)
    return min(bisect.bisect_right(c, rng.random() * c[-1]), len(c) - 1)


_CDFS: dict[int, tuple[np.ndarray, list[float]]] = {}


def _cdf(q: np.ndarray) -> list[float]:
    """Cumulative sums of q as a Python list (bisect on 8-16 floats beats numpy), memoised by
    identity: the checks draw from a handful of cached arrays millions of times."""
    hit = _CDFS.get(id(q))
    if hit is None or hit[0] is not q:
        if len(_CDFS) > 4096:
            _CDFS.clear()
        hit = _CDFS[id(q)] = (q, np.cumsum(q).tolist())
    return hit[1]


def gumbel_top_k(q: np.ndarray, k: int, rng: np.random.Generator, exclude: Sequence[int] = ()) -> list[int]:
    """k tokens drawn from q without replacement, in draw order, never one in `exclude` and never
    one with zero mass (fewer than k when q's support is smaller)."""
    with np.errstate(divide="ignore"):
        keys = np.log(q) + rng.gumbel(size=len(q))
    if len(exclude):
        keys[list(exclude)] = -np.inf
    order = np.argsort(-keys, kind="stable")[:k]
    return [int(t) for t in order if np.isfinite(keys[t])]


def context_shift(prefix: tuple[int, ...]) -> int:
    return sum(t + 1 for t in prefix)


def ngram_guess(v: int) -> Callable[[tuple[int, ...]], int]:
    """A deterministic per-context token, standing in for an n-gram lookup's proposal."""
    return lambda prefix: (context_shift(prefix) + v // 2) % v


def chain_builder(draft: Target, depth: int) -> Builder:
    """A chain of `depth` tokens, each drawn from the draft after its prefix."""

    def build(prefix: tuple[int, ...], rng: np.random.Generator) -> DraftTree:
        tokens, qs, ctx = [prefix[-1] if prefix else 0], [], prefix
        for _ in range(depth):
            q = draft(ctx)
            qs.append(q)
            tokens.append(draw(q, rng))
            ctx = ctx + (tokens[-1],)
        n = depth + 1
        return DraftTree(tokens, list(range(-1, depth)), list(range(n)), [True] + [False] * depth, qs + [None])

    return build


def tree_builder(draft: Target, point_token: Callable[[tuple[int, ...]], int], k: int) -> Builder:
    """A point child first (token point_token(prefix)), then k siblings from the draft without
    replacement excluding it (Gumbel-top-k); every first-level child gets one drafted child."""

    def build(prefix: tuple[int, ...], rng: np.random.Generator) -> DraftTree:
        tree = DraftTree.root(prefix[-1] if prefix else 0)
        q = draft(prefix)
        tree.q[0] = q
        first = int(point_token(prefix))
        kids = [tree.add(0, first, point=True)]
        kids += [tree.add(0, x, point=False) for x in gumbel_top_k(q, k, rng, exclude=(first,))]
        for c in kids:
            q2 = draft(prefix + (tree.tokens[c],))
            tree.q[c] = q2
            tree.add(c, draw(q2, rng), point=False)
        return tree

    return build


def rolled(dist: np.ndarray) -> Target:
    """The context-dependent distribution: dist rolled by context_shift(prefix)."""
    by_shift: dict[int, np.ndarray] = {}
    by_prefix: dict[tuple[int, ...], np.ndarray] = {}

    def at(prefix: tuple[int, ...]) -> np.ndarray:
        r = by_prefix.get(prefix)
        if r is None:
            h = context_shift(prefix) % len(dist)
            if h not in by_shift:
                by_shift[h] = np.roll(dist, h)
            r = by_prefix[prefix] = by_shift[h]
        return r

    return at


def zero_mass_draft(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """q with zero mass on p's top ceil(V/4) tokens (renormalised; uniform elsewhere if empty)."""
    v = len(p)
    top = np.argsort(-p, kind="stable")[: max(1, math.ceil(v / 4))]
    q0 = q.copy()
    q0[top] = 0.0
    if q0.sum() <= 0:
        q0 = np.ones(v)
        q0[top] = 0.0
    return q0 / q0.sum()


# --- the suite -------------------------------------------------------------------------------


def run_statistical_checks(
    dists: list[tuple[str, np.ndarray, np.ndarray]],
    *,
    trials: int = 100_000,
    seed: int = 0,
    alpha: float = ALPHA,
    verifier: Verifier = verify_stochastic,
    checks: Sequence[str] = CHECKS,
) -> list[CheckResult]:
    """For each (name, p, q) — target p and draft q over the same small vocabulary — run the
    `checks` (default all of CHECKS: `chain`, `tree`, `chain_zero_q`; see the module docstring).
    Deterministic in `seed`; each check has its own generator."""
    unknown = set(checks) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks {sorted(unknown)}; known: {list(CHECKS)}")
    results = []
    for pair, (name, p, q) in enumerate(dists):
        p = _as_probs(p, f"{name}: p")
        q = _as_probs(q, f"{name}: q")
        if p.shape != q.shape:
            raise ValueError(f"{name}: p {p.shape} and q {q.shape} differ in shape")
        v = len(p)
        target, draft = rolled(p), rolled(q)
        plans = {
            "chain": (chain_builder(draft, 2), 2),
            "tree": (tree_builder(draft, ngram_guess(v), TREE_SAMPLED_SIBLINGS), 1),
            "chain_zero_q": (chain_builder(rolled(zero_mass_draft(p, q)), 2), 2),
        }
        for i, check in enumerate(CHECKS):
            if check not in checks:
                continue
            build, n_tokens = plans[check]
            rng = np.random.default_rng([seed, pair, i])
            results.append(
                check_tree_exact(
                    f"{name}:{check}",
                    target,
                    build,
                    n_tokens=n_tokens,
                    trials=trials,
                    rng=rng,
                    alpha=alpha,
                    verifier=verifier,
                )
            )
    return results
