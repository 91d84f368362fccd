"""Drafters propose tokens for the target to verify. The decoding drafters share one interface
(`Drafter`, drafters/base.py: what the engine's tick calls); `DRAFTERS` maps the draft's kind
(a draft model, one with another tokenizer drafting through text, or an EAGLE-3 head:
`draft_kind`) to them. Prompt lookup (`NgramDrafter`) is
grafted onto their trees by the session."""

from __future__ import annotations

from edgespec.drafters.base import DraftBatch, Drafter, DraftReport
from edgespec.drafters.eagle3 import Eagle3Drafter
from edgespec.drafters.model import ModelDrafter
from edgespec.drafters.ngram import NgramDrafter
from edgespec.drafters.text import TextDrafter

DRAFTERS: dict[str, type] = {"model": ModelDrafter, "text": TextDrafter, "eagle3": Eagle3Drafter}


def drafter_class(name: str) -> type:
    try:
        return DRAFTERS[name]
    except KeyError:
        raise KeyError(f"unknown drafter {name!r}; known: {', '.join(sorted(DRAFTERS))}") from None


def draft_kind(arch: str) -> str:
    """The drafter for a draft GGUF of this architecture (a draft model with another tokenizer
    drafts with "text": the engine decides that from the pairing)."""
    return "eagle3" if arch == "eagle3" else "model"


__all__ = ["DRAFTERS", "DraftBatch", "DraftReport", "Drafter", "Eagle3Drafter", "ModelDrafter", "NgramDrafter",
           "TextDrafter", "draft_kind", "drafter_class"]
