"""The tiny head's prompts, in the order the trainer took them (the head itself: `tiny_head` in
tests/conftest.py, shared with tests/headtrain/)."""

from __future__ import annotations

from tests.conftest import TRAIN_PROMPTS

__all__ = ["TRAIN_PROMPTS", "synthetic_prompts"]


def synthetic_prompts(n: int) -> list[str]:
    """The tiny head's prompts in train-first order: [0, TRAIN_PROMPTS) trained on, then the one
    held out (the trainer takes category_prompts' first `heldout_prompts` as held out)."""
    from edgespec.headtrain.prompts import category_prompts

    ps = [p for _, p in category_prompts(TRAIN_PROMPTS + 1)]
    return (ps[1:] + ps[:1] + [p for _, p in category_prompts(n + TRAIN_PROMPTS + 1)][TRAIN_PROMPTS + 1:])[:n]
