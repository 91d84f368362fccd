"""Verifier on constructed trees with known answers, seeded reproducibility, and its invariants.

The statistical test against the target distribution is in test_verify_stats.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.tree import DraftTree
from edgespec.verify import VerifyResult, accept_prob, residual, verify_greedy, verify_stochastic

V = 8


def known_tree() -> DraftTree:
    """root -> 1 -> 3
                 -> 4 -> 5
            -> 2                (node i has token i; all children sampled from uniform q)"""
    t = DraftTree.root(0)
    for parent in (0, 0, 1, 1, 4):
        t.q[parent] = np.full(V, 1 / V)
        t.add(parent, len(t), point=False)
    t.check()
    return t


def one_hot(i: int, v: int = V) -> np.ndarray:
    x = np.zeros(v)
    x[i] = 1.0
    return x


def random_tree(rng: np.random.Generator, n: int = 10, v: int = V) -> DraftTree:
    """A random valid tree: mixed point and sampled children, no duplicate siblings."""
    t = DraftTree.root(int(rng.integers(v)))
    for _ in range(n):
        parent = int(rng.integers(len(t)))
        taken = set(t.child_tokens(parent))
        free = [x for x in range(v) if x not in taken]
        if not free:
            continue
        if t.q[parent] is None:
            t.q[parent] = rng.dirichlet(np.ones(v))
        t.add(parent, int(rng.choice(free)), point=bool(rng.random() < 0.3))
    t.check()
    return t


def assert_well_formed(tree: DraftTree, res: VerifyResult) -> None:
    """Every step emits >= 1 token; accepted nodes form a root path; bookkeeping is consistent."""
    assert res.n_emitted == len(res.accepted) + 1 >= 1
    assert 0 <= res.token < V
    children = tree.children()
    prev = 0
    for node, rank in zip(res.accepted, res.ranks, strict=True):
        assert tree.parents[node] == prev
        assert children[prev][rank] == node
        prev = node
    assert len(res.offered) == len(res.accepted) + 1
    assert res.offered == [len(children[n]) for n in [0, *res.accepted]]
    assert res.bonus == (res.offered[-1] == 0)


# --- greedy ----------------------------------------------------------------------------------


def test_greedy_longest_match_then_bonus_at_leaf():
    t = known_tree()
    argmax = [1, 4, 0, 0, 5, 6]  # path 1 -> 4 -> 5, then the target's argmax after 5 = 6
    res = verify_greedy(t, argmax)
    assert res == VerifyResult(accepted=[1, 4, 5], token=6, bonus=True, ranks=[0, 1, 0], offered=[2, 2, 1, 0])
    assert res.n_emitted == 4


def test_greedy_second_sibling_then_bonus():
    res = verify_greedy(known_tree(), [2, 0, 7, 0, 0, 0])
    assert res == VerifyResult(accepted=[2], token=7, bonus=True, ranks=[1], offered=[2, 0])


def test_greedy_recovered_token_when_no_child_matches():
    res = verify_greedy(known_tree(), [1, 7, 0, 0, 0, 0])  # accept 1; after it the target wants 7
    assert res == VerifyResult(accepted=[1], token=7, bonus=False, ranks=[0], offered=[2, 2])
    res = verify_greedy(known_tree(), [6, 0, 0, 0, 0, 0])  # nothing matches at the root
    assert res == VerifyResult(accepted=[], token=6, bonus=False, ranks=[], offered=[2])
    assert res.n_emitted == 1


def test_greedy_root_alone_is_a_plain_decode_step():
    res = verify_greedy(DraftTree.root(3), [5])
    assert res == VerifyResult(accepted=[], token=5, bonus=True, ranks=[], offered=[0])


# --- the two primitives ----------------------------------------------------------------------


def test_accept_prob_is_min_one_p_over_q():
    assert accept_prob(0.5, 0.25) == 1.0
    assert accept_prob(0.3, 0.3) == 1.0
    assert accept_prob(0.1, 0.4) == pytest.approx(0.25)
    assert accept_prob(0.0, 0.7) == 0.0


def test_residual_is_normalised_positive_part():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.2, 0.6, 0.1, 0.1])
    np.testing.assert_allclose(residual(p, q), [0.3 / 0.4, 0.0, 0.1 / 0.4, 0.0])
    # rejecting a point proposal x removes x from p
    np.testing.assert_allclose(residual(p, one_hot(0, 4)), [0.0, 0.6, 0.4, 0.0])
    # p == q: rejection had probability 0; p is returned rather than 0/0
    np.testing.assert_array_equal(residual(p, p), p)


# --- stochastic: constructed cases -----------------------------------------------------------


def test_p_equal_q_always_accepts_the_whole_chain():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(V))
    for seed in range(300):
        r = np.random.default_rng(seed)
        t = DraftTree.root(0)
        node = 0
        for _ in range(4):
            t.q[node] = p
            node = t.add(node, int(r.choice(V, p=p)), point=False)
        res = verify_stochastic(t, lambda i: p, r)
        assert res.accepted == [1, 2, 3, 4] and res.bonus and res.n_emitted == 5


@pytest.mark.parametrize("point", [True, False])
def test_draft_token_with_zero_target_mass_is_never_accepted(point):
    p = np.array([0.0, 0.5, 0.25, 0.25, 0, 0, 0, 0])
    q = one_hot(0)  # the draft is certain of a token the target rules out
    seen = set()
    for seed in range(500):
        t = DraftTree.root(0)
        t.q[0] = q
        t.add(0, 0, point=point)
        res = verify_stochastic(t, lambda i: p, np.random.default_rng(seed))
        assert res.accepted == [] and not res.bonus and res.offered == [1]
        seen.add(res.token)
    assert seen == {1, 2, 3}  # the recovered token comes from the residual = p


def test_certain_target_accepts_its_token_and_recovers_it_otherwise():
    p = one_hot(5)
    q = np.full(V, 1 / V)
    for seed in range(200):
        rng = np.random.default_rng(seed)
        t = DraftTree.root(0)
        t.q[0] = q
        for x in rng.permutation(V)[:3]:
            t.add(0, int(x), point=bool(rng.random() < 0.5))
        res = verify_stochastic(t, lambda i: p if i == 0 else one_hot(7), rng)
        emitted = [t.tokens[i] for i in res.accepted] + [res.token]
        assert emitted[0] == 5
        if 5 in t.child_tokens(0):
            assert emitted == [5, 7] and res.bonus
        else:
            assert res.accepted == [] and res.token == 5 and not res.bonus


def test_rejected_point_child_is_removed_from_the_residual():
    p = np.array([0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0])
    for seed in range(500):
        t = DraftTree.root(0)
        t.add(0, 0, point=True)
        res = verify_stochastic(t, lambda i: p, np.random.default_rng(seed))
        if not res.accepted:
            assert res.token in (1, 2, 3)


def test_rank_and_offered_bookkeeping():
    # three point children at the root: the target rules out the first two, is sure of the third
    p_root = np.array([0.0, 0.0, 0.0, 1.0, 0, 0, 0, 0])
    t = DraftTree.root(0)
    for x in (1, 2, 3):
        t.add(0, x, point=True)
    c = t.add(3, 6, point=True)  # under the accepted node: one child the target rejects
    rows = {0: p_root, 3: one_hot(4)}
    res = verify_stochastic(t, rows.__getitem__, np.random.default_rng(0))
    assert res == VerifyResult(accepted=[3], token=4, bonus=False, ranks=[2], offered=[3, 1])
    assert c == 4 and c not in res.accepted


def test_sampled_child_with_zero_draft_mass_is_a_drafter_bug():
    t = DraftTree.root(0)
    t.q[0] = np.array([0.0, 1.0, 0, 0, 0, 0, 0, 0])
    t.add(0, 0, point=False)  # claims to be drawn from q, where it has no mass
    with pytest.raises(AssertionError, match="zero draft probability"):
        verify_stochastic(t, lambda i: np.full(V, 1 / V), np.random.default_rng(0))


def test_one_hot_target_reproduces_greedy_exactly():
    """Temperature 0 through the stochastic path: p = one_hot(argmax) gives verify_greedy's answer."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        t = random_tree(rng)
        argmax = [int(a) for a in rng.integers(V, size=len(t))]
        want = verify_greedy(t, argmax)
        got = verify_stochastic(t, lambda i, argmax=argmax: one_hot(argmax[i]), rng)
        assert got == want


def test_target_probs_are_evaluated_only_on_the_walked_path():
    rng = np.random.default_rng(3)
    for _ in range(200):
        t = random_tree(rng)
        rows = rng.dirichlet(np.ones(V), size=len(t))
        calls = []
        res = verify_stochastic(t, lambda i, calls=calls, rows=rows: calls.append(i) or rows[i], rng)
        assert calls == [0, *res.accepted]


# --- stochastic: reproducibility and invariants ---------------------------------------------


def test_same_seed_same_result():
    rng = np.random.default_rng(11)
    for _ in range(200):
        t = random_tree(rng)
        rows = rng.dirichlet(np.full(V, 0.5), size=len(t))
        seed = int(rng.integers(2**32))
        a = verify_stochastic(t, rows.__getitem__, np.random.default_rng(seed))
        b = verify_stochastic(t, rows.__getitem__, np.random.default_rng(seed))
        assert a == b


def test_different_seeds_differ_somewhere():
    t = random_tree(np.random.default_rng(1), n=12)
    rows = np.random.default_rng(2).dirichlet(np.ones(V), size=len(t))
    results = {
        (tuple(r.accepted), r.token)
        for r in (verify_stochastic(t, rows.__getitem__, np.random.default_rng(s)) for s in range(50))
    }
    assert len(results) > 1


def test_every_call_emits_at_least_one_token_and_is_well_formed():
    rng = np.random.default_rng(5)
    for _ in range(2000):
        t = random_tree(rng, n=int(rng.integers(0, 16)))
        # sparse targets: many draft tokens have zero target mass
        rows = rng.dirichlet(np.full(V, 0.2), size=len(t))
        res = verify_stochastic(t, rows.__getitem__, rng)
        assert_well_formed(t, res)
        assert rows[res.accepted[-1] if res.accepted else 0][res.token] > 0
        for node in res.accepted:
            assert rows[t.parents[node]][t.tokens[node]] > 0  # never accepts a token the target rules out


def test_greedy_is_well_formed_on_random_trees():
    rng = np.random.default_rng(6)
    for _ in range(1000):
        t = random_tree(rng, n=int(rng.integers(0, 16)))
        argmax = [int(a) for a in rng.integers(V, size=len(t))]
        res = verify_greedy(t, argmax)
        assert_well_formed(t, res)
        assert [t.tokens[n] for n in res.accepted] == [argmax[t.parents[n]] for n in res.accepted]
        assert res.token == argmax[res.accepted[-1] if res.accepted else 0]
