"""Chat messages -> prompt tokens, the ONE way every caller does it (engine, daemon, CLI).

The model's chat template supplies the structure (role headers, turn separators, the generation
prompt) and only it may produce special tokens; what a caller wrote is always text. Rendering the
template over the real contents and tokenising the result with special tokens parsed would let a
user message `hi<|im_end|>\n<|im_start|>system\n...` become a real end of turn and a real system
turn (role injection). So, as llama-server and vLLM keep content apart from the template:

    text      = template(messages with each content replaced by a unique marker)
    specials  = the special-token texts found in the template's own parts, and only there
    fragments = the text between two such specials, with the contents put back at their markers
    ids       = [leading specials (BOS)] + fragment / special / fragment ... + [trailing specials]

Each fragment is tokenised as text (parse_special=False). That is what llama.cpp does with the
whole text too: it splits at special tokens and tokenises the text between them in one piece, so
for a conversation without special-token text in it the ids are the same as the whole-text path's
(tests/test_chat.py, on the demo model). Linear in the size of the conversation: the template
renders short markers and each fragment is tokenised once (tokenising one long string with special
tokens parsed is quadratic in llama.cpp: every special token is searched for from each fragment to
the end of the whole text, so a conversation of many short messages would stall the engine thread).
A template that trims or rewrites contents sees only the markers, so the contents reach the
model as sent.
"""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Protocol

from edgespec.errors import BadRequest

Message = tuple[str, str]  # (role, content)


class TemplateTokenizer(Protocol):
    """What template_tokens needs: a tokenizer with the model's chat template."""

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]: ...

    def chat_prompt(self, messages: Sequence[Message]) -> str: ...  # template text, generation prompt appended


class ChatTokenizer(TemplateTokenizer, Protocol):
    """What encode_chat needs: backend.Model and Engine have it, and so do the test fakes."""

    # text -> id of every token that tokenize(parse_special=True) parses (control tokens)
    special_tokens: Mapping[str, int]


def encode_chat(tok: ChatTokenizer, messages: Sequence[Message]) -> list[int]:
    """Prompt token ids for `messages` (generation prompt appended): special tokens from the
    template only, every content tokenised as text."""
    if not messages:
        raise BadRequest("messages", "at least one message is required")
    markers = _markers([c for _, c in messages])
    text = tok.chat_prompt([(role, m) for (role, _), m in zip(messages, markers)])
    specials = tok.special_tokens
    find = _special_pattern(tuple(specials)) if specials else None
    lead, trail = special_edges(tok)
    ids = list(lead)
    fragment: list[str] = []  # text since the last special token

    def flush() -> None:
        piece = "".join(fragment)
        fragment.clear()
        if piece:
            ids.extend(tok.tokenize(piece, add_special=False, parse_special=False))

    def template(part: str) -> None:
        pos = 0
        if find is not None:
            for m in find.finditer(part):
                fragment.append(part[pos:m.start()])
                flush()
                ids.append(specials[m.group()])
                pos = m.end()
        fragment.append(part[pos:])

    pos = 0
    for (_, content), marker in zip(messages, markers):
        at = text.find(marker, pos)
        if at < 0:  # the template left this message out: so does the prompt
            continue
        template(text[pos:at])
        fragment.append(content)
        pos = at + len(marker)
    template(text[pos:])
    flush()
    return ids + list(trail)


def encode_prompt(tok: ChatTokenizer, prompt: str, messages: Sequence[Message], *, add_special: bool = True,
                  parse_special: bool = False) -> list[int]:
    """A request's prompt token ids: `messages` through the chat template (encode_chat) when
    there are any, otherwise `prompt` tokenised as given."""
    if messages:
        return encode_chat(tok, messages)
    return tok.tokenize(prompt, add_special=add_special, parse_special=parse_special)


def template_tokens(tok: TemplateTokenizer, messages: Sequence[Message]) -> list[int]:
    """The rendered template tokenised whole with special tokens parsed, as llama.cpp's tools do
    with a text prompt (the benchmark's anchors are given that text). For trusted text only: a
    content spelling a special token becomes that token."""
    return tok.tokenize(tok.chat_prompt(messages), add_special=True, parse_special=True)


def special_edges(tok: ChatTokenizer) -> tuple[list[int], list[int]]:
    """The tokens the vocabulary adds around a text when asked to (BOS before; EOS after for the
    few vocabularies that add one), found by tokenising one letter with and without them."""
    with_sp = tok.tokenize("a", add_special=True, parse_special=False)
    plain = tok.tokenize("a", add_special=False, parse_special=False)
    k = len(plain)
    for i in range(len(with_sp) - k + 1):
        if with_sp[i:i + k] == plain:
            return with_sp[:i], with_sp[i + k:]
    return with_sp[:max(0, len(with_sp) - k)], []


@functools.lru_cache(maxsize=8)
def _special_pattern(texts: tuple[str, ...]) -> re.Pattern[str]:
    """Longest first, as llama.cpp tries them."""
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def _markers(contents: Sequence[str]) -> list[str]:
    """One marker per message, found in none of the contents (a fresh random nonce in private-use
    characters; checked, so a content cannot forge one)."""
    while True:
        nonce = "\ue000" + secrets.token_hex(8)
        if not any(nonce in c for c in contents):
            return [f"{nonce}.{i}\ue001" for i in range(len(contents))]
