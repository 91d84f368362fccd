"""The draft token tree: a plain dataclass with derived views.

Node 0 is the root: the last emitted token, whose target logits give the distribution of the
first drafted token. Every other node i has a parent `parents[i] < i`, a depth
`depths[i] = depths[parents[i]] + 1` and a token. Siblings are kept in the order they were
proposed: that order is the order the verifier tries them in, which exactness requires.

How a child was proposed matters for stochastic verification:
- `point[i] = False`: drawn from the parent's draft distribution `q[parent]`, without replacement
  and excluding every earlier sibling's token (Gumbel-top-k does exactly this);
- `point[i] = True`: proposed deterministically (n-gram lookup, greedy top-k at temperature 0):
  its proposal distribution is a point mass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class DraftTree:
    tokens: list[int]  # [n]
    parents: list[int]  # [n], parents[0] == -1
    depths: list[int]  # [n], depths[0] == 0
    point: list[bool]  # [n], point[0] is meaningless
    q: list[np.ndarray | None] = field(default_factory=list)  # [n] draft dist. at node i (over the vocab) or None

    @classmethod
    def root(cls, token: int) -> DraftTree:
        return cls(tokens=[int(token)], parents=[-1], depths=[0], point=[True], q=[None])

    def add(self, parent: int, token: int, point: bool) -> int:
        """Append a child of `parent`; returns its index."""
        assert 0 <= parent < len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.point.append(bool(point))
        self.q.append(None)
        return len(self.tokens) - 1

    def pop(self) -> None:
        """Remove the last node added (a leaf: every child comes after its parent)."""
        assert len(self.tokens) > 1, "the root stays"
        for a in (self.tokens, self.parents, self.depths, self.point, self.q):
            a.pop()

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_draft(self) -> int:
        """Drafted nodes (excluding the root)."""
        return len(self.tokens) - 1

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def children(self) -> list[list[int]]:
        ch: list[list[int]] = [[] for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            ch[self.parents[i]].append(i)
        return ch

    def child_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in range(1, len(self.tokens)) if self.parents[i] == node]

    def leaves(self) -> list[int]:
        has_child = set(self.parents[1:])
        return [i for i in range(len(self.tokens)) if i not in has_child]

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (root excluded)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def leaf_sets(self) -> tuple[list[int], list[list[int]]]:
        """(leaves, per-node list of leaf ordinals below or at the node). A node's KV cells belong
        to the sequences of all leaves under it."""
        leaves = self.leaves()
        below: list[list[int]] = [[] for _ in self.tokens]
        for li, leaf in enumerate(leaves):
            n = leaf
            while n >= 0:
                below[n].append(li)
                n = self.parents[n]
        return leaves, below

    def check(self) -> None:
        """Assert the invariants (used in tests)."""
        n = len(self.tokens)
        assert len(self.parents) == len(self.depths) == len(self.point) == len(self.q) == n
        assert self.parents[0] == -1 and self.depths[0] == 0
        for i in range(1, n):
            p = self.parents[i]
            assert 0 <= p < i, f"node {i}: parent {p} must precede it"
            assert self.depths[i] == self.depths[p] + 1, f"node {i}: depth"
        for node, kids in enumerate(self.children()):
            toks = [self.tokens[k] for k in kids]
            assert len(set(toks)) == len(toks), f"node {node}: duplicate sibling tokens {toks}"
            if any(not self.point[k] for k in kids):
                assert self.q[node] is not None, f"node {node}: sampled children need q"
