"""The drafter interface the engine's tick calls (after llama.cpp's common/speculative:
begin -> draft -> accept), and the draft batch its generators yield.

A drafter drives one request on one slot's range of a shared draft context (local seq 0 = the
committed context, the others its tree's branches). Per step the tick calls, in this order:

    propose_steps(...) or absorb_steps(...)   generators: each yields the `DraftBatch` of its next
                                              draft forward and is sent that forward's rows
                                              (tick/draft.py: level l of every session in ONE
                                              forward); they return a DraftReport
    add_features(rows)                        drafters with `features = True` (an EAGLE-3 head):
                                              the target's features of the context tokens that
                                              forward committed (prefill pieces too)
    accept(tree, accepted, tokens)            verification kept `accepted`; drop rejected branches

`ModelDrafter` (a draft model) and `Eagle3Drafter` (a head over the target's features) implement
it; `edgespec.drafters.DRAFTERS` maps their names to them. Prompt lookup (`NgramDrafter`) needs no
forward: the session grafts its continuations onto the tree directly.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edgespec.sampling import SamplingParams
from edgespec.shape import Shape
from edgespec.tree import DraftTree


@dataclass
class DraftReport:
    seconds: float = 0.0
    batches: list[int] = field(default_factory=list)  # batch size of each draft forward
    levels: int = 0  # levels drafted
    spine_probs: list[float] = field(default_factory=list)  # draft prob of the first child, level by level, along the first choices


@dataclass(frozen=True)
class DraftBatch:
    """One draft forward a drafter asks for: tokens at positions in its local seq ids, and which
    entries need output rows; for a head, `embd` [n, head n_embd] is each entry's g input."""

    tokens: list[int]
    positions: list[int]
    seqs: list[tuple[int, ...]]
    logits: list[bool]
    embd: np.ndarray | None = None


def decode_batch(ctx: Any, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[Sequence[int]],
                 logits: Sequence[bool], embd: np.ndarray | None = None) -> np.ndarray:
    """Decode one (possibly merged) draft batch on `ctx` (a backend.Context or HeadContext); the
    rows of its marked entries."""
    if embd is None:
        return ctx.decode_rows(tokens, positions, seqs, logits)
    return ctx.decode_rows(tokens, positions, seqs, logits, embd=embd)


def run_alone(steps, ctx):
    """Drive a drafter generator alone: decode each DraftBatch on `ctx`, send back its rows."""
    try:
        batch = next(steps)
        while True:
            rows = decode_batch(ctx, batch.tokens, batch.positions, batch.seqs, batch.logits, batch.embd)
            batch = steps.send(rows)
    except StopIteration as stop:
        return stop.value


# a drafter's step generator: yields the DraftBatch each level needs, is sent that batch's rows
# (None to start), returns its DraftReport (tick/draft.py drives it)
DraftSteps = Generator["DraftBatch", "np.ndarray | None", "DraftReport | None"]


class Drafter(Protocol):
    name: str
    features: bool  # reads the target's features (add_features after every target forward)
    ctx: object  # its slot's range of the shared draft context

    def begin(self, tokens: list[int], kept=None, features_from: int = 0) -> int:
        """A new request whose context (prompt) is `tokens`; the last one is the tree's root.
        `kept`: what an earlier request left on this range (`keep`); returns the context tokens
        that saved. `features_from`: the first context index whose target features will come
        (the target's prompt cache kept the KV before it; a drafter with `features` that keeps
        fewer indices than that cannot draft this request and takes no features)."""

    def backlog(self, tokens: list[int]) -> int:
        """Entries the next proposal decodes before drafting (its first level's catch-up)."""

    def propose_steps(self, tree: DraftTree, tokens: list[int], shape: Shape, sampling: SamplingParams,
                      rng: np.random.Generator, mask: Callable[[list[int]], np.ndarray] | None = None,
                      adjust: Callable[[np.ndarray, list[int]], np.ndarray] | None = None) -> DraftSteps:
        """Grow `tree` (rooted at tokens[-1]) within `shape`, one yielded DraftBatch per level.
        `mask(path)`: the tokens a grammar allows after the drafted `path`; `adjust(logits, path)`:
        the request's logit_bias and penalties applied to a draft row (edgespec/penalties.py)."""

    def absorb_steps(self, tokens: list[int], budget: int) -> DraftSteps:
        """Catch up on at most `budget` entries of the backlog without drafting (a plain step)."""

    def add_features(self, features: np.ndarray) -> None:
        """The target's features of the next context tokens (drafters with `features` only)."""

    def accept(self, tree: DraftTree, accepted: list[int], tokens: list[int]) -> None:
        """Verification kept `accepted` (node indices); `tokens` is now the whole context, with
        the next root last. Drafters drop every trace of rejected branches."""

    def keep(self, tokens: list[int]):
        """What the range holds for the next request on it (None: nothing reusable)."""

    def end(self) -> None:
        """The request is over: release per-request state."""

    def check_kv(self, tokens: list[int]) -> None:
        """Between steps: the range holds the committed context only (asserts; tests)."""
