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


def lookup(tokens: list[int], max_len: int, n_max: int = 4, n_min: int = 2) -> list[int]:
    """Longest-suffix match (n from n_max down to n_min), most recent occurrence first."""
    L = len(tokens)
    if L < n_min + 1 or max_len <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = arr[L - n:]
        # candidate starts: positions i < L - n where arr[i:i+n] == suffix
        hits = np.flatnonzero(arr[: L - n] == suffix[0])
        for i in hits[::-1]:
            if i + n < L and np.array_equal(arr[i:i + n], suffix):
                cont = arr[i + n: i + n + max_len]
                if len(cont):
                    return [int(t) for t in cont]
    return []


class NgramDrafter:
    name = "ngram"

    def __init__(self, max_tokens: int = 8, n_max: int = 4, n_min: int = 2):
        self.max_tokens = max_tokens
        self.n_max = n_max
        self.n_min = n_min
        self.nodes: list[int] = []  # the path grafted by the last propose()

    def begin(self, tokens: list[int]) -> None:
        pass

    def propose(self, tree: DraftTree, tokens: list[int], shape: Shape, sampling: SamplingParams,
                rng: np.random.Generator, limit: int | None = None) -> DraftReport:
        """Graft the lookup continuation onto `tree`: follow existing children that already hold
        the proposed tokens, then append the rest as a chain of point nodes (after any sibling
        the model proposed, so sampled siblings keep their proposal order). `self.nodes` lists
        the nodes on the grafted path."""
        cont = lookup(tokens, self.max_tokens if limit is None else limit, self.n_max, self.n_min)
        node = 0
        self.nodes = []
        for tok in cont:
            existing = next((c for c in range(1, len(tree)) if tree.parents[c] == node and tree.tokens[c] == tok), None)
            node = existing if existing is not None else tree.add(node, tok, point=True)
            self.nodes.append(node)
        return DraftReport()

    def accept(self, tree: DraftTree, accepted: list[int], tokens: list[int]) -> None:
        pass

    def end(self) -> None:
        pass
