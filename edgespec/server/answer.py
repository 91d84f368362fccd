"""A streamed answer as the HTTP APIs see it, whatever their wire format: typed events that
http_stream.py produces from the engine's chunks (tool calls already parsed out of the text)
and each API's stream formatter turns into its own server-sent events
(openai_api.CompletionStream, anthropic_api.MessageStream, responses_api.ResponseStream).

One answer may hold n choices (OpenAI's `n`): every event names its choice's index. Order: for
each choice, Text and Call events as the engine steps it, then its End; once every choice has
ended, one Usage. A thinking model's Reasoning events come before its Text and Call events. Waiting comes whenever the request has waited a while with nothing to say (in
the queue, or reading a long prompt): a formatter answers it with a keep-alive.

Pure: no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from edgespec.tools import CallDelta
from edgespec.types import GenerationResult, TokenLogprob


@dataclass(frozen=True)
class Text:
    """Answer text of choice `index` (with its tokens' logprobs when asked for)."""

    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    offset: int = 0  # characters of this choice's text before this piece


@dataclass(frozen=True)
class Reasoning:
    """Reasoning text of choice `index` (a thinking model's <think> block, its tags left out)."""

    index: int
    text: str


@dataclass(frozen=True)
class Call:
    """A piece of a tool call of choice `index`: its header, then fragments of its arguments."""

    index: int
    delta: CallDelta


@dataclass(frozen=True)
class End:
    """Choice `index` ended on its own. finish: the engine's reason ("eos", "stop", "length"),
    or "tool_calls" when the answer was calls; stop_sequence: the stop string that ended it."""

    index: int
    result: GenerationResult
    finish: str
    timings: Mapping[str, float] = field(default_factory=dict)
    stop_sequence: str | None = None


@dataclass(frozen=True)
class Usage:
    """Every choice ended: their results, and the prompt's length (counted once)."""

    results: Sequence[GenerationResult]
    prompt_tokens: int


@dataclass(frozen=True)
class Waiting:
    """Nothing to say yet: the request waits (in the queue, or for its first token)."""


Event = Text | Reasoning | Call | End | Usage | Waiting


class StreamFormat(Protocol):
    """An API's wire format for a stream: bytes to send for each event, for an error that ends
    the stream, and at its end."""

    def start(self) -> bytes: ...

    def event(self, ev: Event) -> bytes: ...

    def error(self, status: int, message: str, openai_body: Mapping) -> bytes: ...

    def end(self) -> bytes: ...
