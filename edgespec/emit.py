"""Emitting tokens as text: ends exactly where plain decoding would (EOS, stop string,
max_tokens) and never sends half a character.

Text is decoded incrementally: an incomplete UTF-8 tail is held back while the request runs and
dropped when it ends (a max_tokens cut in the middle of a multi-byte character must not end the
text in U+FFFD; the token ids keep it). Text that may be the start of a stop string is held back
until it is known not to be one.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

from edgespec.types import FinishReason


class Emitter:
    def __init__(self, max_tokens: int, stop: Sequence[str], is_eog: Callable[[int], bool],
                 piece: Callable[[int], bytes]):
        self.max_tokens = max_tokens
        self.stop = tuple(stop)
        self._is_eog = is_eog
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.out: list[int] = []  # emitted token ids
        self._text = ""  # decoded text of complete characters
        self._final: str | None = None  # the text cut at a stop string
        self._sent = 0  # characters handed out so far
        self.finish_reason: FinishReason | None = None

    def push(self, tokens: Sequence[int]) -> tuple[list[int], str]:
        """Append tokens one by one until one ends the request; returns (tokens taken, newly
        final text)."""
        taken: list[int] = []
        for t in tokens:
            if self.finish_reason is not None:
                break
            if self._is_eog(t):
                self.finish_reason = "eos"
                break
            self.out.append(t)
            taken.append(t)
            self._text += self._decoder.decode(self._piece(t))
            if self.stop:
                cut = _find_stop(self._text, self.stop, self._sent)
                if cut is not None:
                    self._final = self._text[:cut]
                    self.finish_reason = "stop"
                    break
            if len(self.out) >= self.max_tokens:
                self.finish_reason = "length"
                break
        text = self.visible()
        delta = text[self._sent:]
        self._sent = len(text)
        return taken, delta

    def visible(self) -> str:
        """The text a caller may see now: cut at the stop string once found; while running, short
        of anything that may start a stop string."""
        if self._final is not None:
            return self._final
        text = self._text
        if self.finish_reason is None:
            hold = max((_overlap(text, s) for s in self.stop), default=0)
            text = text[: len(text) - hold]
        return text


def _find_stop(text: str, stops: Sequence[str], since: int) -> int | None:
    """Index where the earliest stop string starts, searching only text not yet sent."""
    best = None
    for s in stops:
        i = text.find(s, max(0, since - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
