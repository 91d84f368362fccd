"""Prompt-lookup drafter: matches, multiple continuations as a tree, exactness of grafting."""

from __future__ import annotations

import numpy as np

from edgespec.shape import PLAIN
from edgespec.tick import graft
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


def test_graft_budget_prices_extra_verification_in_plain_tokens():
    """k lookup tokens are grafted when E[min(L, k)] beats the extra verification time counted in
    plain-decoding tokens: on a flat curve even a weak 1-token guess pays, on a steep one only
    a reliable long lookup does."""
    from types import SimpleNamespace

    from edgespec.controller.cost import CostModel
    from edgespec.engine import NGRAM_MAX, Session

    flat = CostModel.from_tables({1: 0.012, 2: 0.012, 4: 0.014, 8: 0.020, 16: 0.032}, {1: 0.005})
    steep = CostModel.from_tables({1: 0.012, 2: 0.021, 4: 0.028, 8: 0.036, 16: 0.044}, {1: 0.005})
    weak = [0.2] + [0.05] * (NGRAM_MAX - 1)
    strong = [0.9 ** (j + 1) for j in range(NGRAM_MAX)]

    def budget(cost, reach, base=1, context=0):
        ngram = NgramDrafter()
        ngram.reach = [reach, reach]
        return graft.budget(SimpleNamespace(engine=SimpleNamespace(cost=cost), ngram=ngram, n_past=context), base)

    assert budget(flat, weak) == 1
    assert budget(steep, weak) == 0
    assert budget(steep, strong) >= 4
    assert budget(flat, strong) == NGRAM_MAX
    # on top of a 5-token chain the marginal cost is what counts: on the steep curve a 6th token
    # costs 2 ms (1/6 of a plain token) where a 2nd costs 9 ms, so the weak guess now pays
    assert budget(steep, weak, base=5) == 1
    # at a long context every verified token costs more (attention reads the whole cache): the
    # weak guess that pays on the flat curve near the calibration context does not at 8000 tokens
    flat.ctx.one, flat.ctx.each = 2.0e-6, 0.8e-6
    assert budget(flat, weak, context=100) == 1 and budget(flat, weak, context=8000) == 0
