"""Drafters propose tokens for the target to verify. They share one small interface
(`Drafter`: begin / propose / accept); `DRAFTERS` maps config names to them."""

from __future__ import annotations

from edgespec.drafters.base import Drafter, DraftReport
from edgespec.drafters.model import ModelDrafter
from edgespec.drafters.ngram import NgramDrafter

DRAFTERS: dict[str, type] = {"model": ModelDrafter, "ngram": NgramDrafter}


def drafter_class(name: str) -> type:
    try:
        return DRAFTERS[name]
    except KeyError:
        raise KeyError(f"unknown drafter {name!r}; known: {', '.join(sorted(DRAFTERS))}") from None


__all__ = ["DRAFTERS", "DraftReport", "Drafter", "ModelDrafter", "NgramDrafter", "drafter_class"]
