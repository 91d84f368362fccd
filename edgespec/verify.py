"""Tree (and chain) verification: pure numpy, no I/O, no llama.cpp.

Greedy: accept the longest path whose tokens equal the target's argmax; the target's argmax at
the node where the path stops is emitted too (the "recovered" token, or the "bonus" at a leaf).

Stochastic: exact multi-draft rejection sampling, applied recursively down the tree. At a node
with target distribution p and candidate children x_1..x_k (tried in proposal order), candidate
x_i was proposed from q_i, the proposal given the earlier (rejected) siblings:
  - sampled children: q_i = q with the earlier siblings' tokens removed, renormalised
    (drawing without replacement), i.e. Recursive Rejection Sampling (Jeon et al. 2024);
  - point children (n-gram / deterministic): q_i = one-hot(x_i).
    accept x_i with probability min(1, p_i(x_i) / q_i(x_i))        # p: target, q: draft
    on rejection p_{i+1} = norm(max(0, p_i - q_i))                 # the residual
If x_i is accepted we descend into it; if every child is rejected we emit a sample of the last
residual; at a leaf we emit a sample of p (the bonus). By the single-draft lemma applied at each
candidate, the emitted sequence is distributed exactly as the target's. We sample WITHOUT
replacement: it never spends a tree node on a duplicate sibling, and rejecting x_i removes x_i
from both p (mostly) and q, so later siblings are accepted more often than with replacement.

Every step emits at least one token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from edgespec.sampling import sample
from edgespec.tree import DraftTree

_EPS = 1e-12


@dataclass
class VerifyResult:
    accepted: list[int]  # [a] node indices of the accepted path, root excluded, by depth
    token: int  # the token emitted after them: bonus (leaf reached) or recovered (all children rejected)
    bonus: bool
    ranks: list[int]  # [a] sibling rank (0 = first proposed) of each accepted node
    offered: list[int]  # [a + 1] candidate children at each node on the path; last = where it stopped

    @property
    def n_emitted(self) -> int:
        return len(self.accepted) + 1


def verify_greedy(tree: DraftTree, target_argmax: Sequence[int]) -> VerifyResult:
    """target_argmax[i] = the target's argmax after node i ([n] ints)."""
    children = tree.children()
    node = 0
    accepted: list[int] = []
    ranks: list[int] = []
    offered: list[int] = []
    while True:
        want = int(target_argmax[node])
        kids = children[node]
        offered.append(len(kids))
        hit = next((r for r, c in enumerate(kids) if tree.tokens[c] == want), None)
        if hit is None:
            return VerifyResult(accepted, want, bonus=not kids, ranks=ranks, offered=offered)
        node = kids[hit]
        accepted.append(node)
        ranks.append(hit)


def accept_prob(p_x: float, q_x: float) -> float:
    """min(1, p/q): the chance of keeping a draft token x with target mass p_x, draft mass q_x."""
    return 1.0 if p_x >= q_x else p_x / q_x


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)); falls back to p when p == q (then rejection had probability 0)."""
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    return r / s if s > _EPS else p


def verify_stochastic(
    tree: DraftTree,
    target_probs: Callable[[int], np.ndarray],
    rng: np.random.Generator,
) -> VerifyResult:
    """target_probs(i) -> [vocab] target distribution after node i (evaluated lazily: only on the
    path actually walked)."""
    children = tree.children()
    node = 0
    accepted: list[int] = []
    ranks: list[int] = []
    offered: list[int] = []
    while True:
        p = target_probs(node)
        kids = children[node]
        offered.append(len(kids))
        if not kids:
            return VerifyResult(accepted, sample(p, rng), bonus=True, ranks=ranks, offered=offered)
        q_model = tree.q[node]
        removed = 0.0  # q_model mass of the earlier (rejected) siblings: sampling without replacement
        tried: list[int] = []
        for rank, c in enumerate(kids):
            x = tree.tokens[c]
            if tree.point[c]:
                q_i_x = 1.0
            else:
                assert q_model is not None, f"node {node}: a sampled child under a parent without q"
                q_i_x = float(q_model[x]) / (1.0 - removed)
                if q_i_x <= 0.0:
                    raise AssertionError(f"node {c}: sampled token {x} has zero draft probability")
            if rng.random() < accept_prob(float(p[x]), q_i_x):
                node = c
                accepted.append(c)
                ranks.append(rank)
                break
            if tree.point[c]:
                q_i = np.zeros_like(p)
                q_i[x] = 1.0
            else:
                assert q_model is not None
                q_i = q_model.astype(np.float64, copy=True)
                if tried:
                    q_i[tried] = 0.0
                q_i /= 1.0 - removed
            if q_model is not None:  # later sampled siblings are drawn excluding x, point or not
                removed += float(q_model[x])
            tried.append(x)
            p = residual(p, q_i)
        else:
            return VerifyResult(accepted, sample(p, rng), bonus=False, ranks=ranks, offered=offered)
