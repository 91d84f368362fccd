"""DraftTree: invariants, paths, leaves, leaf sets, children order, duplicate siblings caught."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.tree import DraftTree


def sample_tree() -> DraftTree:
    """root(7) -> a(1) -> c(3)
                       -> d(4) -> e(5)
               -> b(2)                 (children listed in proposal order)"""
    t = DraftTree.root(7)
    t.q[0] = np.full(8, 1 / 8)
    a = t.add(0, 1, point=False)
    b = t.add(0, 2, point=False)
    t.q[a] = np.full(8, 1 / 8)
    t.add(a, 3, point=True)
    d = t.add(a, 4, point=False)
    t.add(d, 5, point=True)
    t.q[d] = np.full(8, 1 / 8)
    assert (a, b, d) == (1, 2, 4)
    return t


def test_root_alone():
    t = DraftTree.root(42)
    t.check()
    assert len(t) == 1 and t.n_draft == 0 and t.max_depth == 0
    assert t.tokens == [42] and t.parents == [-1] and t.depths == [0]
    assert t.leaves() == [0]
    assert t.path(0) == []
    assert t.children() == [[]]


def test_add_returns_index_and_sets_depth():
    t = sample_tree()
    t.check()
    assert len(t) == 6 and t.n_draft == 5 and t.max_depth == 3
    assert t.tokens == [7, 1, 2, 3, 4, 5]
    assert t.parents == [-1, 0, 0, 1, 1, 4]
    assert t.depths == [0, 1, 1, 2, 2, 3]
    assert t.point[1:] == [False, False, True, False, True]
    assert t.q[3] is None and t.q[5] is None


def test_children_keep_proposal_order():
    t = sample_tree()
    assert t.children() == [[1, 2], [3, 4], [], [], [5], []]
    assert t.child_tokens(0) == [1, 2]
    assert t.child_tokens(1) == [3, 4]
    assert t.child_tokens(2) == []


def test_paths_exclude_root_and_run_by_depth():
    t = sample_tree()
    assert t.path(5) == [1, 4, 5]
    assert [t.tokens[i] for i in t.path(5)] == [1, 4, 5]
    assert t.path(2) == [2]
    for i in range(1, len(t)):
        path = t.path(i)
        assert len(path) == t.depths[i] and path[-1] == i
        assert all(t.parents[path[j]] == (path[j - 1] if j else 0) for j in range(len(path)))


def test_leaves_and_leaf_sets():
    t = sample_tree()
    assert t.leaves() == [2, 3, 5]
    leaves, below = t.leaf_sets()
    assert leaves == [2, 3, 5]
    # root carries every sequence; a node carries the leaves in its subtree
    assert below == [[0, 1, 2], [1, 2], [0], [1], [2], [2]]
    for node in range(len(t)):
        for li in below[node]:
            assert node == 0 or node in t.path(leaves[li])


def test_chain_is_a_tree_with_one_leaf():
    t = DraftTree.root(0)
    node = 0
    for tok in (4, 4, 4):  # repeated tokens along a path are fine; only siblings must differ
        t.q[node] = np.full(5, 0.2)
        node = t.add(node, tok, point=False)
    t.check()
    assert t.leaves() == [3]
    assert t.path(3) == [1, 2, 3]
    assert t.leaf_sets() == ([3], [[0], [0], [0], [0]])


def test_duplicate_siblings_caught():
    t = DraftTree.root(0)
    t.q[0] = np.full(4, 0.25)
    t.add(0, 2, point=True)
    t.add(0, 2, point=False)
    with pytest.raises(AssertionError, match="duplicate sibling"):
        t.check()


def test_sampled_children_need_q():
    t = DraftTree.root(0)
    t.add(0, 1, point=True)
    t.check()  # point children need no draft distribution
    t.add(0, 2, point=False)
    with pytest.raises(AssertionError, match="need q"):
        t.check()


def test_broken_parent_and_depth_caught():
    t = sample_tree()
    t.parents[2] = 3  # parent after child
    with pytest.raises(AssertionError, match="precede"):
        t.check()
    t = sample_tree()
    t.depths[5] = 1
    with pytest.raises(AssertionError, match="depth"):
        t.check()
    t = sample_tree()
    t.q.pop()
    with pytest.raises(AssertionError):
        t.check()


def test_add_rejects_unknown_parent():
    t = DraftTree.root(0)
    with pytest.raises(AssertionError):
        t.add(1, 3, point=True)
