"""Prompt-lookup drafter: matches, multiple continuations as a tree, exactness of grafting."""

from __future__ import annotations

import numpy as np

from edgespec.controller.shapes import PLAIN
from edgespec.drafters.ngram import NgramDrafter, lookup, lookup_all
from edgespec.sampling import SamplingParams
from edgespec.tree import DraftTree


def test_lookup_longest_suffix_most_recent():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    assert lookup(toks, 2) == [5, 6]  # the most recent earlier "1 2 3" is followed by 5 6
    assert lookup([7, 8, 9], 4) == []
    assert lookup(toks, 0) == []


def test_lookup_all_distinct_first_tokens():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3, 5, 7, 1, 2, 3]
    assert lookup_all(toks, 2, branches=3) == [[5, 7], [4, 9]]


def test_graft_as_tree_and_merge_with_existing_children():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    tree = DraftTree.root(3)
    tree.q[0] = None
    first = tree.add(0, 5, point=True)  # a model proposal that the lookup shares
    NgramDrafter(max_tokens=3, branches=2).propose(tree, toks, PLAIN, SamplingParams(), np.random.default_rng(0))
    tree.check()
    kids = tree.children()
    assert [tree.tokens[c] for c in kids[0]] == [5, 4]  # 5 reused (not duplicated), 4 a new branch
    assert tree.child_tokens(first) == [6]
