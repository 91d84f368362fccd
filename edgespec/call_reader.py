"""CallReader: one tool call's JSON object read as it streams, a character at a time, for the
Hermes block parser (edgespec.tools) and the JSON families of the other formats
(edgespec.tool_formats)."""

from __future__ import annotations

import json

_WS = " \t\n\r"  # JSON's whitespace


class CallReader:
    """One call block's JSON object ({"name": ..., "arguments": ...}) read as it streams, a
    character at a time: `name` once its string is whole; `arguments` the arguments value's JSON
    text so far, exactly as written (what is read later only extends it); `arguments_done` once
    it is whole. `broken`: the text is not an object of that shape (nothing more is read); a
    value's own validity is json.loads's to judge when the block is whole (_call)."""

    def __init__(self, args_keys: tuple[str, ...] = ("arguments",)) -> None:
        self._args_keys = args_keys  # the key the arguments come under ("parameters" in Llama's calls)
        self.consumed = 0  # characters read, the closing brace included
        self.name: str | None = None
        self._arguments: list[str] = []  # the arguments' text, a character a piece
        self._taken = 0  # pieces handed out by take()
        self.arguments_done = False
        self.broken = False
        self.closed = False  # the object's closing brace was read
        # open -> first (after "{") -> key -> colon -> value_start -> value -> after -> key_start ...
        self._state = "open"
        self._key = ""  # the key being read (its JSON text), then the key
        self._keys: set[str] = set()
        self._value = ""  # the name's JSON text while it is read
        self._depth = 0  # brackets open inside the value
        self._in_str = False
        self._esc = False

    @property
    def arguments(self) -> str:
        return "".join(self._arguments)

    def take(self) -> str:
        """The arguments' text read since the last take()."""
        out = "".join(self._arguments[self._taken:])
        self._taken = len(self._arguments)
        return out

    def feed(self, text: str) -> None:
        for ch in text:
            if self.broken or self.closed:
                return
            self.consumed += 1
            self._step(ch)

    def _step(self, ch: str) -> None:
        st = self._state
        if st == "value":
            self._value_char(ch)
        elif st == "key":
            self._key += ch
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                try:
                    key = json.loads(self._key)
                except ValueError:
                    self.broken = True
                    return
                if key in self._keys and (key == "name" or key in self._args_keys):
                    self.broken = True  # a second name or arguments: json.loads would keep the last
                self._keys.add(key)
                self._key, self._state = key, "colon"
        elif ch in _WS:
            return
        elif st == "value_start":
            self._state, self._value, self._depth, self._in_str = "value", "", 0, False
            self._value_char(ch)
        elif (st, ch) in (("open", "{"), ("colon", ":"), ("after", ",")):
            self._state = {"open": "first", "colon": "value_start", "after": "key_start"}[st]
        elif st in ("first", "key_start") and ch == '"':
            self._key, self._state, self._esc = '"', "key", False
        elif st in ("first", "after") and ch == "}":
            self.closed = True
        else:
            self.broken = True

    def _take(self, ch: str) -> None:
        if self._key in self._args_keys:
            self._arguments.append(ch)
        elif self._key == "name":
            self._value += ch

    def _value_char(self, ch: str) -> None:
        if self._in_str:
            self._take(ch)
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                if self._depth == 0:
                    self._end_value()
        elif ch == '"':
            self._take(ch)
            self._in_str = True
        elif ch in "{[":
            self._take(ch)
            self._depth += 1
        elif ch in "}]" and self._depth > 0:
            self._take(ch)
            self._depth -= 1
            if self._depth == 0:
                self._end_value()
        elif self._depth == 0 and (ch in ",}]" or ch in _WS):  # a number, true, false or null ended
            self._end_value()
            self._step(ch)
        else:
            self._take(ch)

    def _end_value(self) -> None:
        self._state = "after"
        if self._key == "name":
            try:
                name = json.loads(self._value)
            except ValueError:
                name = None
            if not isinstance(name, str):
                self.broken = True
                return
            self.name = name
        elif self._key in self._args_keys:
            self.arguments_done = True
