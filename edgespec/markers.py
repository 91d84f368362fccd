"""The markers the answer's parsers read (a <think> block's tags, each call format's tags) when a
model's vocabulary holds one as a control token.

A control token renders empty in the answer's text (llama.cpp's token_to_piece without special
text), so a model whose `<think>` or `[TOOL_CALLS]` is one control token would write it and the
parsers would never see it. Such a token is found by its id (the vocabulary's control tokens
whose text is a marker) and rendered as its text: then the reasoning split, the call parsers
and the grammar (which reads a token's bytes) see it as the marker it is, whichever way the model
writes it (the one control token, or the marker spelled in ordinary tokens). llama.cpp's chat
parsers do the same ("preserved tokens"). Every other control token still renders empty.

Pure: no I/O, no engine.
"""

from __future__ import annotations

from collections.abc import Mapping

from edgespec import reasoning, tool_formats

MARKERS: frozenset[str] = frozenset((reasoning.OPEN, reasoning.CLOSE, *tool_formats.MARKERS))


def preserved(special_tokens: Mapping[str, int]) -> dict[int, bytes]:
    """The control tokens (text -> id, as backend.Model.special_tokens) that are markers: id -> text."""
    return {t: text.encode() for text, t in special_tokens.items() if text in MARKERS}

