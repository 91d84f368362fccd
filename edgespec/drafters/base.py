"""The drafter interface (after llama.cpp's common/speculative: begin -> draft -> accept)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from edgespec.controller.shapes import Shape
from edgespec.sampling import SamplingParams
from edgespec.tree import DraftTree


@dataclass
class DraftReport:
    seconds: float = 0.0
    batches: list[int] = field(default_factory=list)  # batch size of each draft forward
    levels: int = 0  # levels drafted
    spine_probs: list[float] = field(default_factory=list)  # draft prob of the first child, level by level, along the first choices


class Drafter(Protocol):
    name: str

    def begin(self, tokens: list[int]) -> None:
        """A new request whose context (prompt) is `tokens`; the last one is the tree's root."""

    def propose(self, tree: DraftTree, tokens: list[int], shape: Shape, sampling: SamplingParams,
                rng: np.random.Generator) -> DraftReport:
        """Grow `tree` (rooted at tokens[-1]) in place within `shape`."""

    def accept(self, tree: DraftTree, accepted: list[int], tokens: list[int]) -> None:
        """Verification kept `accepted` (node indices); `tokens` is now the whole context, with
        the next root last. Drafters drop every trace of rejected branches."""

    def end(self) -> None:
        """The request is over: release per-request state."""
