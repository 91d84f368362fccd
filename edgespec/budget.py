"""A reasoning budget (Anthropic's thinking.budget_tokens, edgespec.reasoning_budget): a thinking
model's <think> block held to at most N tokens. While the block is open each token is drawn as
usual; once N tokens of it are spent, the close text the chat template writes after a block
(`\\n</think>\\n\\n`) is forced, one token a step, and the answer follows.

It is a mask, composed with the request's grammar (the constraint after the reasoning, or free
text): at a state inside the block nothing more is masked, at a forced step every token but the
close's next one is. So it holds in every speculative mode exactly as a grammar does (the verifier
reads masked rows: edgespec/constraint.py), and the answer is drawn from exactly the distribution
plain decoding with the same rule draws from. What that distribution is: up to the budget the
target's own (under the request's mask); after a forced close, the target's given that close. When
the model would have reasoned longer, the answer is not the one the target would have given
after its whole reasoning: the budget truncates it, by design.

The block's state is read from the tokens' bytes: it opens when the answer begins with <think>
(or the prompt opened it), it ends at the first </think> the model writes, or at the budget.

Pure: numpy over the grammar's masks, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from edgespec.constraint import Compiler, Matcher, NodeMasks
from edgespec.reasoning import CLOSE, OPEN
from edgespec.tree import DraftTree
from edgespec.types import ConstraintSpec, ReasoningBudget

_OPEN, _CLOSE = OPEN.encode(), CLOSE.encode()


@dataclass(frozen=True)
class State:
    """start: the block may still open (`seen`: the answer's bytes so far); think: open, `count`
    tokens spent (`tail`: its last bytes, where a </think> may begin); close: the close's `k`th
    token is next; free: the block is over (or never opened)."""

    phase: str
    count: int = 0
    seen: bytes = b""
    k: int = 0


class BudgetMatcher:
    """A Matcher (edgespec/constraint.py) whose masks also hold a reasoning budget."""

    def __init__(self, inner: Matcher, budget: ReasoningBudget, token_bytes: Sequence[bytes], close: Sequence[int]):
        if budget.tokens < 1 or not close:
            raise ValueError("a reasoning budget needs at least one token and a close text")
        self.inner, self.budget = inner, budget
        self.n_vocab = inner.n_vocab
        self._bytes = token_bytes
        self.close = [int(t) for t in close]
        self.state = self._initial()

    def _initial(self) -> State:
        return State("think") if self.budget.opened else State("start")

    # ---- the budget's automaton ------------------------------------------------------------------

    def forced_token(self, st: State) -> int | None:
        """The one token the budget allows at `st`, or None when it allows any."""
        return self.close[st.k] if st.phase == "close" else None

    def step(self, st: State, token: int) -> State | None:
        """The state after `token`; None when the budget does not allow it there."""
        b = self._bytes[token] if 0 <= token < len(self._bytes) else b""
        if st.phase == "close":
            if token != self.close[st.k]:
                return None
            return State("free") if st.k + 1 == len(self.close) else State("close", k=st.k + 1)
        if st.phase == "free":
            return st
        if st.phase == "start":
            seen = (st.seen + b).lstrip()
            if seen.startswith(_OPEN):
                return self._spent(State("think"), seen[len(_OPEN):])
            return State("start", seen=seen) if _OPEN.startswith(seen) else State("free")
        return self._spent(st, b)

    def _spent(self, st: State, b: bytes) -> State:
        """One more token of the block, `b` its bytes: the block ends at a </think>, or is closed
        by force once the budget is spent."""
        window = st.seen + b
        if _CLOSE in window:
            return State("free")
        count = st.count + 1
        if count >= self.budget.tokens:
            return State("close")
        return State("think", count=count, seen=window[-(len(_CLOSE) - 1):])

    def _walk(self, path: Sequence[int]) -> State | None:
        st: State | None = self.state
        for t in path:
            if st is None:
                return None
            st = self.step(st, int(t))
        return st

    def _restrict(self, mask: np.ndarray, st: State | None) -> np.ndarray:
        if st is None:
            return np.zeros_like(mask)
        e = self.forced_token(st)
        if e is None:
            return mask
        out = np.zeros_like(mask)
        out[e] = mask[e]
        return out

    # ---- Matcher's interface ---------------------------------------------------------------------

    def mask(self) -> np.ndarray:
        return self._restrict(self.inner.mask(), self.state)

    def bitmask(self) -> np.ndarray:
        return _pack(self.mask(), (self.n_vocab + 31) // 32)

    def node_bits(self, tree: DraftTree) -> NodeMasks:
        """The grammar's masks, each node's restricted to the close's next token where the budget
        forces one; a node whose path the budget forbids is not valid (its mask empty)."""
        nm = self.inner.node_bits(tree)
        bits, valid = nm.bits.copy(), nm.valid.copy()
        states: list[State | None] = [self.state]
        for i in range(1, len(tree)):
            parent = states[tree.parents[i]]
            st = self.step(parent, tree.tokens[i]) if parent is not None and valid[i] else None
            states.append(st)
            if st is None:
                valid[i] = False
                bits[i] = 0
        for i, st in enumerate(states):
            e = self.forced_token(st) if st is not None else None
            if e is not None:
                word, bit = divmod(e, 32)
                keep = bits[i, word] & np.array([1 << bit], dtype=np.uint32).view(np.int32)[0]
                bits[i] = 0
                bits[i, word] = keep
        return replace(nm, bits=bits, valid=valid)

    def node_masks(self, tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
        nm = self.node_bits(tree)
        return nm.dense(), nm.valid

    def mask_after(self, path: Sequence[int]) -> np.ndarray:
        return self._restrict(self.inner.mask_after(path), self._walk(path))

    def forced(self, limit: int) -> list[int]:
        """The close's rest while it is forced; the grammar's forced tokens once the block is over."""
        st = self.state
        if st.phase == "close":
            return self.close[st.k:st.k + limit]
        return self.inner.forced(limit) if st.phase == "free" else []

    def allows(self, tokens: Sequence[int]) -> bool:
        return self._walk(tokens) is not None and self.inner.allows(tokens)

    def commit(self, tokens: Sequence[int]) -> None:
        st = self._walk(tokens)
        if st is None:
            raise RuntimeError(f"reasoning budget: tokens {list(tokens)} are not allowed at this state")
        self.inner.commit(tokens)
        self.state = st

    def allow(self, constrained: int) -> None:
        self.inner.allow(constrained)

    def waiting(self) -> bool:
        return self.inner.waiting()

    def defer(self) -> None:
        self.inner.defer()

    @property
    def deferred(self) -> int:
        return self.inner.deferred

    def reset(self) -> None:
        self.inner.reset()
        self.state = self._initial()

    @property
    def finished(self) -> bool:
        return self.inner.finished

    @property
    def failure(self) -> str | None:
        return self.inner.failure

    @property
    def accepting(self) -> bool:
        return self.inner.accepting and self.state.phase != "close"


def matcher(compiler: Compiler, spec: ConstraintSpec) -> Matcher | BudgetMatcher:
    """A request's grammar state (Compiler.matcher), held to its reasoning budget when it has one."""
    m = compiler.matcher(spec)
    if spec.budget is None:
        return m
    return BudgetMatcher(m, spec.budget, compiler.vocab.tokens, compiler.vocab.tokenize(spec.budget.close))


def _pack(mask: np.ndarray, words: int) -> np.ndarray:
    out = np.zeros(words * 32, dtype=bool)
    out[: len(mask)] = mask
    return np.packbits(out, bitorder="little").view(np.int32)
