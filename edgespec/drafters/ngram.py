"""Model-free prompt lookup: if the last n tokens occurred earlier in the context, propose what
followed them. Costs no forward pass; pays when the answer copies from the prompt (RAG, JSON
extraction, code edits). Proposals are deterministic (point masses), so they can be grafted onto
any tree: a point candidate is exact under recursive rejection sampling."""

from __future__ import annotations

import numpy as np

from edgespec.controller.shapes import Shape
from edgespec.drafters.base import DraftReport
from edgespec.sampling import SamplingParams
from edgespec.tree import DraftTree


def lookup_all(tokens: list[int], max_len: int, n_max: int = 4, n_min: int = 2,
               branches: int = 1) -> list[list[int]]:
    """Up to `branches` continuations with distinct first tokens, for the longest suffix (n from
    n_max down to n_min) that occurred before; most recent occurrence first."""
    L = len(tokens)
    if L < n_min + 1 or max_len <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = arr[L - n:]
        # candidate starts: positions i < L - n where arr[i:i+n] == suffix
        hits = np.flatnonzero(arr[: L - n] == suffix[0])
        out: list[list[int]] = []
        firsts: set[int] = set()
        for i in hits[::-1]:
            if i + n < L and np.array_equal(arr[i:i + n], suffix):
                cont = [int(t) for t in arr[i + n: i + n + max_len]]
                if cont and cont[0] not in firsts:
                    firsts.add(cont[0])
                    out.append(cont)
                    if len(out) == branches:
                        break
        if out:
            return out
    return []


def lookup(tokens: list[int], max_len: int, n_max: int = 4, n_min: int = 2) -> list[int]:
    """The most recent continuation of the longest matching suffix ([] if none)."""
    found = lookup_all(tokens, max_len, n_max, n_min, 1)
    return found[0] if found else []


class NgramDrafter:
    name = "ngram"

    def __init__(self, max_tokens: int = 8, n_max: int = 4, n_min: int = 2, branches: int = 2):
        self.max_tokens = max_tokens
        self.branches = branches  # continuations proposed at once (distinct first tokens)
        self.n_max = n_max
        self.n_min = n_min

    def begin(self, tokens: list[int]) -> None:
        pass

    def propose(self, tree: DraftTree, tokens: list[int], shape: Shape, sampling: SamplingParams,
                rng: np.random.Generator, limit: int | None = None) -> DraftReport:
        """Graft the lookup continuation onto `tree`: follow existing children that already hold
        the proposed tokens, then append the rest as a chain of point nodes (after any sibling
        the model proposed, so sampled siblings keep their proposal order)."""
        conts = lookup_all(tokens, self.max_tokens if limit is None else limit, self.n_max, self.n_min,
                           self.branches if limit is None else 1)
        for cont in conts:  # several continuations graft as a tree (shared prefixes merge)
            self.graft(tree, cont)
        return DraftReport()

    @staticmethod
    def graft(tree: DraftTree, cont: list[int]) -> None:
        """Add one continuation under the root as point nodes, following existing children that
        already hold its tokens."""
        node = 0
        for tok in cont:
            existing = next((c for c in range(1, len(tree)) if tree.parents[c] == node and tree.tokens[c] == tok),
                            None)
            node = existing if existing is not None else tree.add(node, tok, point=True)

    def accept(self, tree: DraftTree, accepted: list[int], tokens: list[int]) -> None:
        pass

    def end(self) -> None:
        pass
