"""One step's KV in its slot's sequence range (kv.SeqRange): where the tree's nodes go in the
target forward, and what survives verification. The only place that lays a tree out in cells or
commits one.

Layout: local seq 0 (the main sequence) holds the context minus the root; each leaf of the tree
gets a sequence (the leaf on the first-child spine gets seq 0, so the common case commits
without a copy), the others a copy of seq 0 (cells shared, not duplicated, in a unified cache).
Node i carries the seq ids of every leaf below it, so it attends exactly to its ancestors.

Commit: seq 0 := context + root + accepted path; every other sequence of the range emptied.
Invariant between steps (`check`): seq 0 holds positions 0 .. len(tokens) - 2 once each, with the
context's tokens, and nothing else survives.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgespec.kv import SeqRange
from edgespec.tree import DraftTree


@dataclass(slots=True)
class Layout:
    """Where one step's tree sits in the range, from the target forward to the commit."""

    leaves: list[int]  # [leaves] node index of each leaf
    below: list[list[int]]  # [nodes] leaf ordinals below each node (itself, for a leaf)
    seq_of_leaf: list[int]  # [leaves] local seq id of each leaf
    order: list[int]  # [nodes] batch order = KV cell order (node indices; the identity for a chain)
    root_pos: int  # the root's position (tokens cached before the forward)


def spine(tree: DraftTree) -> list[int]:
    """Root, its first child, that child's first child, ... down to a leaf (a chain: all)."""
    children = tree.children()
    out, n = [0], 0
    while children[n]:
        n = children[n][0]
        out.append(n)
    return out


def leaf_seqs(leaves: list[int], spine_leaf: int) -> list[int]:
    """Local seq id per leaf ordinal: the leaf on the first-child spine gets seq 0, the others
    1, 2, ..."""
    out, nxt = [], 1
    for leaf in leaves:
        if leaf == spine_leaf:
            out.append(0)
        else:
            out.append(nxt)
            nxt += 1
    return out


def lay_out(tree: DraftTree, tgt: SeqRange, root_pos: int) -> tuple[Layout, list[int], list[int], list[list[int]]]:
    """Copy seq 0 into each further leaf's sequence; return the layout and the step's part of
    the target forward ([root] + tree as tokens, positions, global seq ids, in KV cell order)."""
    leaves, below = tree.leaf_sets()
    assert len(leaves) <= tgt.n_seq_max, f"tree has {len(leaves)} leaves > {tgt.n_seq_max} sequences"
    sp = spine(tree)
    seq_of_leaf = leaf_seqs(leaves, sp[-1])
    for s in seq_of_leaf:
        if s != 0:
            tgt.seq_cp(0, s, -1, -1)
    # batch order = KV cell order: the root and the first-child spine first, so an accepted
    # spine prefix sits in consecutive cells exactly as one-token decoding would place it;
    # the other branches follow
    on_spine = set(sp)
    order = sp + [i for i in range(len(tree)) if i not in on_spine]
    base = tgt.base
    seqs = [[base + seq_of_leaf[li] for li in below[i]] for i in range(len(tree))]
    lay = Layout(leaves, below, seq_of_leaf, order, root_pos)
    return lay, [tree.tokens[i] for i in order], [root_pos + tree.depths[i] for i in order], [seqs[i] for i in order]


def commit(tgt: SeqRange, lay: Layout, accepted: list[int]) -> int:
    """Keep the root and the accepted path in seq 0, empty every other sequence (the rejected
    cells are gone); returns the positions now cached."""
    last = accepted[-1] if accepted else 0
    end = lay.root_pos + 1 + len(accepted)  # cells to keep: [0, end)
    src = lay.seq_of_leaf[lay.below[last][0]]
    if 0 in (lay.seq_of_leaf[li] for li in lay.below[last]):
        src = 0
    tgt.commit_branch(src, lay.root_pos + 1, end, lay.seq_of_leaf)
    return end


def check(tgt: SeqRange, tokens: list[int]) -> None:
    """The invariant between steps (asserts; tests). Where the context can list a sequence's
    cells (the test double's `seq_cells`), per cell: each position of the main sequence exactly
    once, holding the context's token there."""
    want = len(tokens) - 2
    assert tgt.pos_min(0) in (0, -1) and tgt.pos_max(0) == want, \
        f"target seq 0 holds [{tgt.pos_min(0)}, {tgt.pos_max(0)}], expected [0, {want}]"
    for s in range(1, tgt.n_seq_max):
        assert tgt.pos_max(s) == -1, f"target seq {s} still holds cells (up to pos {tgt.pos_max(s)})"
    cells_of = getattr(tgt.ctx, "seq_cells", None)  # test contexts only: llama.cpp lists no cells
    if cells_of is not None:
        cells = cells_of(tgt.base)
        positions = [p for p, _ in cells]
        assert positions == list(range(want + 1)), \
            f"target seq 0 positions are not 0..{want} once each: {_runs(positions)}"
        bad = next((p for p, t in cells if t != tokens[p]), None)
        assert bad is None, f"target seq 0 holds a cell at {bad} that is not the context's token"
        for s in range(1, tgt.n_seq_max):
            assert not cells_of(tgt.base + s), f"target seq {s} still holds cells"


def _runs(positions: list[int]) -> str:
    """A short description of a list of positions: the duplicates and the gaps."""
    seen, dup = set(), []
    for p in positions:
        if p in seen:
            dup.append(p)
        seen.add(p)
    top = max(positions, default=-1)
    gaps = [p for p in range(top + 1) if p not in seen]
    return f"{len(positions)} cells, duplicated {dup[:8]}, missing {gaps[:8]}"
