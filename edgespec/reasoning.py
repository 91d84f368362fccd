"""Reasoning output of thinking models (DeepSeek-R1 and its distills, Qwen3, QwQ, GLM 4.5): the
answer's `<think>…</think>` block split from its content, whole or as it streams, and a
constraint (a JSON schema, a tool grammar) that applies only after the block ends.

The three families share the mark-up: reasoning inside <think> and </think>, the content after.
What differs is who opens the block: R1's template ends its generation prompt with `<think>\\n`
(the answer begins inside the block, with no opening tag), Qwen3 and GLM write `<think>`
themselves, and a template asked not to think (enable_thinking false) closes an empty block in the
prompt (the answer is all content). So a request's reasoning is (format, opened): the format from
the template's text or [target] reasoning_format, `opened` from the rendered prompt's end.

The constraint after the block: a grammar that lets the reasoning run free up to the first
</think> and then holds the rest to the constraint (`after_reasoning`), in llguidance's Lark.
It is one grammar, so the verifier masks every row of a speculative tree with it as with any
other: exactness through the switch is the grammar machinery's own (edgespec/constraint.py).

Pure: no I/O, no engine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from edgespec.types import ConstraintSpec, ReasoningBudget

OPEN, CLOSE = "<think>", "</think>"
FORMATS = ("none", "think")  # [target] reasoning_format, besides auto


# OpenAI's reasoning_effort values, and the <think> block's budget (edgespec/budget.py) each sets:
# minimal and low hold it short; medium and above leave the model its own length; none turns
# thinking off (the template's enable_thinking false)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
EFFORT_BUDGETS = {"minimal": 256, "low": 1024}


def template_variables(effort: str | None, enable_thinking: bool | None) -> dict[str, Any]:
    """The chat template's variables for a request's effort and enable_thinking (None: unset)."""
    out: dict[str, Any] = {}
    if effort is not None:
        out["reasoning_effort"] = effort
        if effort == "none":
            out["enable_thinking"] = False
    if enable_thinking is not None:
        out["enable_thinking"] = enable_thinking
    return out


def detect(source: str) -> str:
    """The reasoning format a chat template's text writes: think when it knows </think>."""
    return "think" if CLOSE in source else "none"


def format_for(template: Any, forced: str = "auto") -> str:
    if forced != "auto":
        return forced
    return "none" if template is None else detect(template.source)


def opened(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves a <think> block open (the answer begins inside it)."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


# free text: what a budget (edgespec/budget.py) is composed with when the request has no constraint
FREE = ConstraintSpec("lark", "start: TEXT\nTEXT: /(.|\\n)*/\n")


@dataclass(frozen=True)
class Reasoning:
    """A request's reasoning: the answer's reasoning is split from its content; `opened` when the
    prompt opened the block; `budget`: the most tokens the block may take (None: no limit)."""

    opened: bool = False
    budget: int | None = None

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole answer. A block never closed (max_tokens) is all
        reasoning."""
        s = ReasoningSplitter(self.opened)
        events = s.feed(text) + s.finish()
        reasoning = "".join(v for k, v in events if k == "reasoning")
        content = "".join(v for k, v in events if k == "content")
        return (reasoning if s.had_reasoning else None), content

    def constraint(self, inner: ConstraintSpec | None) -> ConstraintSpec | None:
        """`inner` held after the block, and the budget on the block (then free text after it
        when `inner` is None)."""
        if self.budget is None:
            return None if inner is None else after_reasoning(inner, self.opened)
        spec = after_reasoning(inner or FREE, self.opened)
        return replace(spec, budget=ReasoningBudget(self.budget, opened=self.opened))


class ReasoningSplitter:
    """The answer's text as it streams -> ("reasoning", text) and ("content", text) events. Text
    that may still be a tag (<think> at the start, </think> inside the block) is held back until
    it cannot; the tags themselves and the blank lines after </think> are never sent."""

    def __init__(self, opened: bool = False):
        self._state = "reasoning" if opened else "start"  # start -> reasoning -> after -> content
        self._buf = ""
        self.had_reasoning = opened

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._buf += text
        while self._buf:
            st = self._state
            if st == "content":
                out.append(("content", self._buf))
                self._buf = ""
            elif st == "start":
                s = self._buf.lstrip()
                if s.startswith(OPEN):
                    self._buf = s[len(OPEN):]
                    self._state, self.had_reasoning = "reasoning", True
                elif not s or OPEN.startswith(s):
                    break
                else:
                    self._state = "content"
            elif st == "reasoning":
                i = self._buf.find(CLOSE)
                if i >= 0:
                    if i:
                        out.append(("reasoning", self._buf[:i]))
                    self._buf = self._buf[i + len(CLOSE):]
                    self._state = "after"
                    continue
                keep = _partial_tail(self._buf, CLOSE)
                if len(self._buf) > keep:
                    out.append(("reasoning", self._buf[:len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                break
            else:  # after: the blank lines between </think> and the content
                self._buf = self._buf.lstrip()
                if self._buf:
                    self._state = "content"
        return out

    def finish(self) -> list[tuple[str, str]]:
        rest, self._buf = self._buf, ""
        if not rest:
            return []
        if self._state == "reasoning":
            return [("reasoning", rest)]
        if self._state == "after":
            return []
        return [("content", rest)]


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# ---- the constraint after the reasoning --------------------------------------------------------

# the reasoning, its </think> and the blank lines after it, as one lexeme: llguidance's lexer is greedy
# and does not backtrack, so a separate whitespace lexeme would race a text answer's own lexeme
_THINK = 'THINK: /(.|\\n)*<\\/think>[ \\t\\r\\n]*/ & ~/(.|\\n)*<\\/think>(.|\\n)*<\\/think>(.|\\n)*/'


def after_reasoning(inner: ConstraintSpec, opened: bool) -> ConstraintSpec:
    """A Lark grammar: the reasoning (free text up to the first </think>; opened by <think> unless
    the prompt `opened` it, and then optional: a model may skip it), blank lines, then `inner`.
    A GBNF grammar cannot be composed so and is left as it is (it then holds the reasoning too)."""
    if inner.kind == "grammar":
        return inner
    rules = [_THINK]
    if inner.kind == "json_schema":
        schema = json.loads(inner.value)
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}}
        rules.append(f"answer: %json {json.dumps(schema)}")
    elif inner.kind == "json_object":
        rules.append('answer: %json {"type": "object", "x-guidance": {"whitespace_flexible": false}}')
    elif inner.kind == "regex":
        rules.append(f"answer: ANSWER\nANSWER: /{inner.value.replace('/', chr(92) + '/')}/")
    else:  # lark: its start rule becomes `answer`
        rules.append(re.sub(r"(?m)^start(\s*:)", r"answer\1", inner.value))
    if opened:
        return ConstraintSpec("lark", "start: THINK answer\n" + "\n".join(rules) + "\n")
    return ConstraintSpec("lark", "start: \"<think>\" THINK answer | answer\n" + "\n".join(rules) + "\n")
