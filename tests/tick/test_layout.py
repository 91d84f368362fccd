"""tick/layout.py on the fake backend's cache (which lists its cells): a tree laid out in a slot's
range attends exactly to its ancestors, and the commit keeps the root and the accepted path in
the main sequence, whichever branch it was on, empties every branch, and leaves the other slots'
ranges alone. Broken twins (a commit from the wrong branch, a layout that puts every node in
every sequence) are caught by the invariant check."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.kv import SeqRange
from edgespec.tick import layout
from edgespec.tree import DraftTree
from tests.fake_backend import FakeContext, FakeModel, bigram_table

N_SEQ = 4
CONTEXT = [0, 5, 9, 14, 3]  # tokens[-1] (3) is the root: positions 0..3 are cached


def ranges():
    ctx = FakeContext(FakeModel(bigram_table()), n_ctx=512, n_seq_max=2 * N_SEQ)
    mine, other = SeqRange(ctx, N_SEQ, N_SEQ, 256), SeqRange(ctx, 0, N_SEQ, 256)
    for r in (mine, other):
        r.decode_seq(CONTEXT[:-1], 0)
    return mine, other


def tree() -> DraftTree:
    """root -> 7 -> 8 -> 9 (the first-child spine), 7 -> 11, root -> 12 -> 13."""
    t = DraftTree.root(CONTEXT[-1])
    a = t.add(0, 7, True)
    b = t.add(a, 8, True)
    t.add(b, 9, True)
    t.add(a, 11, True)
    c = t.add(0, 12, True)
    t.add(c, 13, True)
    return t


def forward(r: SeqRange, t: DraftTree, root_pos: int) -> layout.Layout:
    lay, toks, pos, seqs = layout.lay_out(t, r, root_pos)
    r.ctx.decode_rows(toks, pos, seqs, [True] * len(toks))
    return lay


def test_every_node_attends_exactly_to_its_ancestors():
    mine, _ = ranges()
    t = tree()
    lay, toks, pos, seqs = layout.lay_out(t, mine, len(CONTEXT) - 1)
    assert lay.order[:4] == layout.spine(t) == [0, 1, 2, 3]  # the spine first: consecutive cells
    assert sorted(lay.order) == list(range(len(t)))
    for j, node in enumerate(lay.order):
        assert toks[j] == t.tokens[node] and pos[j] == len(CONTEXT) - 1 + t.depths[node]
        # the node's sequences are exactly its leaves' (so it is seen by its descendants only)
        assert sorted(seqs[j]) == sorted(N_SEQ + lay.seq_of_leaf[li] for li in lay.below[node])
    assert lay.seq_of_leaf[lay.leaves.index(3)] == 0  # the spine's leaf decodes in the main sequence


@pytest.mark.parametrize("accepted", [[], [1], [1, 2, 3], [1, 4], [5, 6]])
def test_the_commit_keeps_the_accepted_path_on_any_branch(accepted):
    mine, other = ranges()
    t = tree()
    root_pos = len(CONTEXT) - 1
    lay = forward(mine, t, root_pos)
    assert layout.commit(mine, lay, accepted) == root_pos + 1 + len(accepted)
    tokens = CONTEXT + [t.tokens[i] for i in accepted] + [99]  # 99: the next root (not cached)
    layout.check(mine, tokens)
    layout.check(other, CONTEXT)  # the other slot's range is untouched


def test_a_commit_from_the_wrong_branch_is_caught(monkeypatch):
    mine, _ = ranges()
    t = tree()
    lay = forward(mine, t, len(CONTEXT) - 1)
    lay.seq_of_leaf = list(reversed(lay.seq_of_leaf))  # the accepted leaf mapped to another branch
    layout.commit(mine, lay, [5, 6])
    with pytest.raises(AssertionError, match="not the context's token|positions are not"):
        layout.check(mine, CONTEXT + [12, 13, 99])


def test_a_layout_that_smears_every_node_into_every_sequence_is_caught():
    mine, _ = ranges()
    t = tree()
    lay, toks, pos, seqs = layout.lay_out(t, mine, len(CONTEXT) - 1)
    every = sorted({q for ss in seqs for q in ss})
    mine.ctx.decode_rows(toks, pos, [every for _ in seqs], [True] * len(toks))
    layout.commit(mine, lay, [1, 2])
    with pytest.raises(AssertionError, match="positions are not"):
        layout.check(mine, CONTEXT + [7, 8, 99])


def test_spine_and_leaf_sequences():
    t = tree()
    assert layout.spine(t) == [0, 1, 2, 3]
    leaves, _ = t.leaf_sets()
    seqs = layout.leaf_seqs(leaves, 3)
    assert sorted(seqs) == list(range(len(leaves))) and seqs[leaves.index(3)] == 0
    assert np.unique(seqs).size == len(seqs)
