"""Tool-call formats of the model families beside Hermes/Qwen2.5's (edgespec.tools): how each
family writes a call, recognised in its chat template, rendered as its template prints it,
constrained by a Lark grammar (llguidance's dialect) whose arguments follow each tool's schema,
and parsed back, whole or a character at a time.

    qwen3_coder   <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
                  </function>\\n</tool_call>
    glm45         <tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>
    llama3        {"name": "NAME", "parameters": {...}}   (after <|python_tag|> too; one call)
    mistral       [TOOL_CALLS] [{"name": "NAME", "arguments": {...}, "id": "abcdefghi"}, ...]
    mistral_v11   [TOOL_CALLS]NAME[ARGS]{...}, repeated (Magistral, Devstral, Mistral Small 3.2)
                  (either Mistral form is parsed by both)
    deepseek_r1   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
                  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

In the XML families (qwen3_coder, glm45) a value is written raw when its schema is a string
(or an enum of strings), as JSON otherwise; the grammar writes the tool's properties in the
schema's order, the required ones always, and nothing else, so the arguments validate (a raw
string's minLength, maxLength, pattern and format are held: a format of _FORMATS' list, a pattern
without lookaround or backreferences; any other is refused naming the field). A
marker the family's vocabulary holds as a control token (Mistral's [TOOL_CALLS], Llama's
<|python_tag|>) renders as its text (edgespec.markers), so the parsers read it and the grammar's
spelling of it allows the control token as well as the text.

Every parser reads a prefix of the answer (`scan`): the calls seen so far, each with its name once
it is whole and the arguments' JSON text so far (what a later read returns only extends it), so
that a stream sends a call's header and then fragments that concatenate to its arguments.

Pure: no I/O, no engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edgespec.call_reader import CallReader
from edgespec.settings import TOOL_FORMATS

# the tags the call formats are parsed by (edgespec.markers: kept as text when a control token)
MARKERS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "[TOOL_CALLS]",
           "[ARGS]", "[CALL_ID]", "<|python_tag|>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
           "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
FORMATS = TOOL_FORMATS
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    """One function a request offers the model (edgespec.tools reads them from the APIs' bodies)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))

    def as_openai(self) -> dict:
        f: dict[str, Any] = {"name": self.name}
        if self.description:
            f["description"] = self.description
        f["parameters"] = dict(self.parameters)
        return {"type": "function", "function": f}


@dataclass(frozen=True)
class Partial:
    """A call as read so far: `name` once whole, `arguments` its arguments' JSON text so far
    (only ever extended), `done` once the call is whole (arguments then final)."""

    name: str | None
    arguments: str = ""
    done: bool = False


@dataclass(frozen=True)
class Scan:
    """The calls read from an answer's text so far; `complete`: the text is nothing but whole
    calls (trailing whitespace aside); `broken`: the text is not this format's calls."""

    calls: tuple[Partial, ...]
    complete: bool = False
    broken: bool = False


# ---- shared helpers ----------------------------------------------------------------------------


def lark_str(s: str) -> str:
    """A Lark string literal."""
    return json.dumps(s, ensure_ascii=False)


def _regex(s: str) -> str:
    return re.sub(r"([\\/.*+?()\[\]{}|^$])", r"\\\1", s)


def _closed(params: Mapping[str, Any]) -> dict:
    """A tool's parameters with undeclared keys refused (as tools._call_schema does)."""
    p = dict(params)
    if "properties" in p and "additionalProperties" not in p:
        p["additionalProperties"] = False
    return p


def _json_rule(schema: Any, key_sep: str = ": ", item_sep: str = ", ") -> str:
    s = dict(schema) if isinstance(schema, Mapping) else {}
    s["x-guidance"] = {"whitespace_flexible": False, "key_separator": key_sep, "item_separator": item_sep}
    return "%json " + json.dumps(s, ensure_ascii=False)


def _stringlike(schema: Any) -> bool:
    """A value written raw in the XML families: a string, or an enum / const of strings."""
    if not isinstance(schema, Mapping):
        return False
    if schema.get("type") == "string":
        return True
    if "enum" in schema and schema["enum"] and all(isinstance(v, str) for v in schema["enum"]):
        return "type" not in schema
    return isinstance(schema.get("const"), str) and "type" not in schema


def _props(params: Mapping[str, Any]) -> list[tuple[str, Any, bool]]:
    """(key, schema with the tool's $defs, required) in the schema's order."""
    props = params.get("properties") or {}
    required = set(params.get("required") or ())
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    out = []
    for k, s in props.items():
        s = dict(s) if isinstance(s, Mapping) else {}
        out.append((k, {**s, **defs} if defs else s, k in required))
    return out


def _value(raw: str, schema: Any) -> Any:
    """A raw XML value as the JSON value it stands for: the text itself for a string, else JSON
    (Python's spellings True / False / None, as a template's `|string` prints them, too)."""
    if _stringlike(schema):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return {"True": True, "False": False, "None": None}.get(raw.strip(), raw)


def _as_template_string(v: Any) -> str:
    """A value as Qwen3-Coder's template prints it: objects and lists as JSON, the rest as Jinja's
    `|string` does (Python's str: True, None, 1.5)."""
    return json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else str(v)


def _args_text(pairs: Sequence[tuple[str, Any]]) -> str:
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                           for k, v in pairs)


def _ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _prefix_of(text: str, pos: int, lit: str) -> str:
    """'yes' when text[pos:] starts with lit, 'maybe' when it is a (short) prefix of lit, else 'no'."""
    rest = text[pos:pos + len(lit)]
    if rest == lit:
        return "yes"
    return "maybe" if lit.startswith(rest) else "no"


# JSON Schema's string formats a raw XML value can be held to (the regexes of llguidance's JSON
# support for the same formats, written out: a raw value is not JSON, so llguidance does not see it)
_FORMATS = {
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "time": r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])",
    "date-time": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[Tt ]([01][0-9]|2[0-3]):[0-5][0-9]:"
                 r"([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@"
             r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
    "hostname": r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*",
}
# what the grammar's regexes (Rust's regex crate) cannot do: lookaround and backreferences
_UNSUPPORTED_PATTERN = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<")


def string_regex(schema: Mapping[str, Any], key: str) -> str:
    """A string schema's `pattern` or `format` as the regex a raw value must match whole (a
    pattern unanchored at an end may have any text there, as JSON Schema reads it); ValueError
    saying why when the grammar cannot hold it."""
    if key == "format":
        f = schema["format"]
        if f not in _FORMATS:
            raise ValueError(f"format {f!r} is not supported in this call format (supported: {', '.join(_FORMATS)})")
        return _FORMATS[f]
    pat = schema["pattern"]
    if not isinstance(pat, str) or _UNSUPPORTED_PATTERN.search(pat):
        raise ValueError(f"pattern {pat!r} is not supported (lookaround and backreferences are not)")
    start, body = pat.startswith("^"), pat.removeprefix("^")
    end = body.endswith("$") and not body.endswith("\\$")
    body = body[:-1] if end else body
    return ("" if start else "(.|\\n)*") + f"({body})" + ("" if end else "(.|\\n)*")


def check_strings(fmt: ToolFormat | None, tools: Sequence[Tool]) -> tuple[str, str] | None:
    """(the parameter's field path, why) of the first raw string parameter whose pattern or
    format the XML families' grammar cannot hold; None when all can be (or `fmt` writes JSON)."""
    if not isinstance(fmt, _Xml):
        return None
    for i, t in enumerate(tools):
        for k, s, _ in _props(t.parameters):
            if not _stringlike(s):
                continue
            for key in ("pattern", "format"):
                if key in s:
                    try:
                        string_regex(s, key)
                    except ValueError as exc:
                        return f"tools[{i}].function.parameters.properties.{k}.{key}", str(exc)
    return None


class ToolFormat:
    """One family's call format. `openers`: how its calls begin (text that begins so is calls);
    `separator`: between two calls in the grammar; `parallel`: whether the family writes more
    than one call; `text_arguments`: its template reads a call's arguments as JSON text (not
    an object)."""

    name = ""
    openers: tuple[str, ...] = ()
    parallel = True
    text_arguments = False

    def detect(self, source: str) -> bool:
        raise NotImplementedError

    def render(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        """Calls as the family's template prints them after an assistant turn's content."""
        raise NotImplementedError

    def call_rules(self, tool: Tool, i: int) -> list[str]:
        """Lark rules, the first defining `call_<i>`: one call of `tool`."""
        raise NotImplementedError

    def shared_rules(self) -> list[str]:
        """Rules and terminals the calls of every tool use (defined once)."""
        return []

    def calls_rule(self, parallel: bool) -> str:
        return 'calls: call ("\\n" call)*' if parallel and self.parallel else "calls: call"

    def scan(self, text: str, tools: Mapping[str, Tool]) -> Scan:
        raise NotImplementedError

    def grammar(self, tools: Sequence[Tool], choice: str, parallel: bool, not_text: Sequence[str] = ()) -> str:
        """The answer's grammar: text that does not open a call (nor begin with `not_text`), or
        calls (tools.ToolSpec's choices)."""
        text = "TEXT: /(.|\\n)*/ & ~/[ \\t\\r\\n]*(" + "|".join(_regex(o) for o in (*self.openers, *not_text)) + \
            ")(.|\\n)*/"
        if choice == "none":
            return f"start: TEXT\n{text}\n"
        rules = []
        for i, t in enumerate(tools):
            rules += self.call_rules(t, i)
        call = "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))
        start = "calls" if choice != "auto" else "TEXT | calls"
        return "\n".join([f"start: {start}", self.calls_rule(parallel and not choice.startswith("function:")),
                          call, *rules, *self.shared_rules(), text]) + "\n"


# ---- Qwen3-Coder's XML -------------------------------------------------------------------------


class _Xml(ToolFormat):
    """The XML families: per call a name, then key/value pairs, each value raw or JSON."""

    value_end = ""  # the text that ends a value
    terminal = ""  # the Lark terminal of a raw string value, its end included
    # a call's opening and name, each (key, value), its end: the family's text
    _CALL: re.Pattern[str]
    _PARAM: re.Pattern[str]
    _END: re.Pattern[str]

    def scan(self, text: str, tools: Mapping[str, Tool]) -> Scan:
        return _scan_xml(text, tools, self._CALL, self._PARAM, self._END, "<tool_call>")

    def _param(self, key: str) -> tuple[str, str]:
        """The text before a value of `key`, and after its end."""
        raise NotImplementedError

    def _string_terminal(self, s: Mapping[str, Any]) -> str:
        """A raw string value and its end, as one terminal: its length, `pattern` (JSON Schema's:
        found anywhere in the value unless anchored) and `format` (string_regex) held, and no
        earlier end in it."""
        end = _regex(self.value_end)
        parts = []
        if "minLength" in s or "maxLength" in s:
            parts.append(f"/(.|\\n){{{int(s.get('minLength', 0))},{s.get('maxLength', '')}}}{end}/")
        for k in ("pattern", "format"):
            if k in s:
                rx = re.sub(r"(?<!\\)/", r"\/", string_regex(s, k))  # a Lark regex ends at its /
                parts.append(f"/({rx}){end}/")
        return " & ".join([*parts, f"~/(.|\\n)*{end}(.|\\n)+/"])

    def _value_rules(self, tool: Tool, i: int) -> tuple[list[str], list[str]]:
        items, rules = [], []
        for j, (k, s, req) in enumerate(_props(tool.parameters)):
            before, after = self._param(k)
            name = f"p{i}_{j}"
            if _stringlike(s) and ("enum" in s or "const" in s):
                vals = s["enum"] if "enum" in s else [s["const"]]
                body = "(" + " | ".join(lark_str(v + self.value_end) for v in vals if isinstance(v, str)) + ")"
            elif _stringlike(s) and any(k in s for k in ("minLength", "maxLength", "pattern", "format")):
                body = f"S{i}_{j}"  # the raw string bounded (length, pattern, format): a terminal of its own
                rules.append(f"{body}: {self._string_terminal(s)}")
            elif _stringlike(s):
                body = self.terminal
            elif s.get("type") == "boolean" and set(s) <= {"type", "description", "title"}:
                # JSON's spelling, or Python's (as Qwen3-Coder's template prints a boolean)
                body = "(" + " | ".join(lark_str(v + self.value_end) for v in ("true", "false", "True", "False")) + ")"
            else:
                body = f"v{i}_{j} {lark_str(self.value_end)}"
                rules.append(f"v{i}_{j}: {_json_rule(s)}")
            rules.append(f"{name}: {lark_str(before)} {body} {lark_str(after)}" if after else
                         f"{name}: {lark_str(before)} {body}")
            items.append(name if req else f"{name}?")
        return items, rules


class Qwen3Coder(_Xml):
    name = "qwen3_coder"
    openers = ("<tool_call>",)
    value_end = "\n</parameter>"
    terminal = "QVAL"

    def detect(self, source: str) -> bool:
        return "<function=" in source and "<parameter=" in source

    def render(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        out = []
        for name, args in calls:
            s = f"<tool_call>\n<function={name}>\n"
            for k, v in args.items():
                v = _as_template_string(v)
                s += f"<parameter={k}>\n{v}\n</parameter>\n"
            out.append(s + "</function>\n</tool_call>")
        return "\n".join(out)

    def _param(self, key: str) -> tuple[str, str]:
        return f"<parameter={key}>\n", "\n"

    def call_rules(self, tool: Tool, i: int) -> list[str]:
        items, rules = self._value_rules(tool, i)
        head = lark_str(f"<tool_call>\n<function={tool.name}>\n")
        return [f"call_{i}: {head} {' '.join(items)} {lark_str('</function>' + chr(10) + '</tool_call>')}", *rules]

    def shared_rules(self) -> list[str]:
        return ['QVAL: /(.|\\n)*\\n<\\/parameter>/ & ~/(.|\\n)*\\n<\\/parameter>(.|\\n)+/']

    _CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>")
    _PARAM = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
    _END = re.compile(r"\s*</function>\s*</tool_call>")


def _scan_xml(text: str, tools: Mapping[str, Tool], call_re: re.Pattern, param_re: re.Pattern,
              end_re: re.Pattern, opener: str) -> Scan:
    """The XML families' calls: opener, name, (key, value)*, end; between calls whitespace."""
    calls: list[Partial] = []
    pos = 0
    while True:
        pos = _ws(text, pos)
        if pos == len(text):
            return Scan(tuple(calls), complete=bool(calls))
        if _prefix_of(text, pos, opener) == "maybe":
            return Scan(tuple(calls))
        if _prefix_of(text, pos, opener) == "no":
            return Scan(tuple(calls), broken=True)
        m = call_re.match(text, pos)
        if m is None:
            return Scan(tuple(calls), broken=len(text) - pos > 300)  # no name is that long
        if m.end() == len(text):
            return Scan(tuple(calls))  # the name may go on
        name = m.group(1).strip()
        props = dict((k, s) for k, s, _ in _props(tools[name].parameters)) if name in tools else {}
        pos = m.end()
        pairs: list[tuple[str, Any]] = []
        while True:
            p = param_re.match(text, pos)
            if p is None:
                break
            key = p.group(1).strip()
            pairs.append((key, _value(p.group(2), props.get(key))))
            pos = p.end()
        e = end_re.match(text, pos)
        args = _args_text(pairs)
        if e is None:
            calls.append(Partial(name, args))
            return Scan(tuple(calls))
        calls.append(Partial(name, args + "}", True))
        pos = e.end()


# ---- GLM 4.5 -----------------------------------------------------------------------------------


class Glm45(_Xml):
    name = "glm45"
    openers = ("<tool_call>",)
    value_end = "</arg_value>"
    terminal = "GVAL"

    def detect(self, source: str) -> bool:
        return "<arg_key>" in source

    def render(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        out = []
        for name, args in calls:
            s = f"<tool_call>{name}\n"
            for k, v in args.items():
                v = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                s += f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
            out.append(s + "</tool_call>")
        return "\n".join(out)

    def _param(self, key: str) -> tuple[str, str]:
        return f"<arg_key>{key}</arg_key>\n<arg_value>", "\n"

    def call_rules(self, tool: Tool, i: int) -> list[str]:
        items, rules = self._value_rules(tool, i)
        return [f"call_{i}: {lark_str('<tool_call>' + tool.name + chr(10))} {' '.join(items)} \"</tool_call>\"", *rules]

    def shared_rules(self) -> list[str]:
        return ['GVAL: /(.|\\n)*<\\/arg_value>/ & ~/(.|\\n)*<\\/arg_value>(.|\\n)+/']

    _CALL = re.compile(r"<tool_call>([^<\n]+)")
    _PARAM = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
    _END = re.compile(r"\s*</tool_call>")


# ---- the JSON families -------------------------------------------------------------------------


def _json_object(text: str, pos: int, keys: tuple[str, ...]) -> tuple[Partial, int, bool] | None:
    """A {"name": ..., <keys[0]>: {...}} object read from text[pos:] (CallReader): the call so
    far, where it ended (when `done`), whether it is whole; None when it is not such an object."""
    r = CallReader(args_keys=keys)
    r.feed(text[pos:])
    if r.broken:
        return None
    if not r.closed:
        return Partial(r.name, r.arguments if r.name is not None else ""), len(text), False
    end = pos + r.consumed
    try:
        obj = json.loads(text[pos:end])
    except ValueError:
        return None
    if not isinstance(obj.get("name"), str) or not any(k in obj for k in keys):
        return None
    return Partial(obj["name"], r.arguments if r.arguments_done else "{}", True), end, True


class Llama3(ToolFormat):
    """Llama 3.1 / 3.2 / 3.3: one JSON object per answer, `parameters` for the arguments; after
    <|python_tag|> (a control token: empty in the answer's text, unless spelled) too."""

    name = "llama3"
    openers = ('{"name"', "<|python_tag|>")
    parallel = False

    def detect(self, source: str) -> bool:
        return "<|python_tag|>" in source or ('"parameters": ' in source and "<|start_header_id|>" in source)

    def render(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def call_rules(self, tool: Tool, i: int) -> list[str]:
        head = "{" + json.dumps("name") + ": " + json.dumps(tool.name) + ", " + json.dumps("parameters") + ": "
        return [f'call_{i}: {lark_str(head)} args_{i} "}}"', f"args_{i}: {_json_rule(_closed(tool.parameters))}"]

    def scan(self, text: str, tools: Mapping[str, Tool]) -> Scan:
        pos = _ws(text, 0)
        if text.startswith("<|python_tag|>", pos):
            pos = _ws(text, pos + len("<|python_tag|>"))
        calls: list[Partial] = []
        while True:
            if pos == len(text):
                return Scan(tuple(calls), complete=bool(calls) and calls[-1].done)
            got = _json_object(text, pos, ("parameters", "arguments"))
            if got is None:
                return Scan(tuple(calls), broken=True)
            call, end, done = got
            calls.append(call)
            if not done:
                return Scan(tuple(calls))
            pos = _ws(text, end)
            if text.startswith(";", pos):
                pos = _ws(text, pos + 1)


class Mistral(ToolFormat):
    """Mistral's v3 tokenizer's list of calls, or (`v11`) the later [TOOL_CALLS]NAME[ARGS]{...}."""

    openers = ("[TOOL_CALLS]",)

    def __init__(self, v11: bool):
        self.v11 = v11
        self.name = "mistral_v11" if v11 else "mistral"

    def detect(self, source: str) -> bool:
        return "[TOOL_CALLS]" in source and ("[ARGS]" in source) == self.v11

    def render(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        if self.v11:
            return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a, ensure_ascii=False)}" for n, a in calls)
        return "[TOOL_CALLS] [" + ", ".join(json.dumps({"name": n, "arguments": a}, ensure_ascii=False)[:-1] +
                                            f', "id": "{i:09d}"}}' for i, (n, a) in enumerate(calls)) + "]"

    def calls_rule(self, parallel: bool) -> str:
        if self.v11:
            return "calls: call+" if parallel else "calls: call"
        more = ' (", " call)*' if parallel else ""
        return f'calls: "[TOOL_CALLS] [" call{more} "]"'

    def call_rules(self, tool: Tool, i: int) -> list[str]:
        if self.v11:
            return [f"call_{i}: {lark_str('[TOOL_CALLS]' + tool.name + '[ARGS]')} args_{i}",
                    f"args_{i}: {_json_rule(_closed(tool.parameters))}"]
        head = "{" + json.dumps("name") + ": " + json.dumps(tool.name) + ", " + json.dumps("arguments") + ": "
        return [f'call_{i}: {lark_str(head)} args_{i} call_id? "}}"',
                f"args_{i}: {_json_rule(_closed(tool.parameters))}"]

    def shared_rules(self) -> list[str]:
        return [] if self.v11 else ['call_id: ", \\"id\\": \\"" /[A-Za-z0-9]{9}/ "\\""']

    def scan(self, text: str, tools: Mapping[str, Tool]) -> Scan:
        pos = _ws(text, 0)
        if _prefix_of(text, pos, "[TOOL_CALLS]") != "yes":
            return Scan((), broken=_prefix_of(text, pos, "[TOOL_CALLS]") == "no")
        pos = _ws(text, pos + len("[TOOL_CALLS]"))
        if pos == len(text):
            return Scan(())
        if text[pos] != "[":
            return _mistral_v11(text, pos)
        pos += 1
        calls: list[Partial] = []
        while True:
            pos = _ws(text, pos)
            if pos == len(text):
                return Scan(tuple(calls))
            got = _json_object(text, pos, ("arguments",))
            if got is None:
                return Scan(tuple(calls), broken=True)
            call, end, done = got
            calls.append(call)
            if not done:
                return Scan(tuple(calls))
            pos = _ws(text, end)
            if text.startswith(",", pos):
                pos += 1
            elif text.startswith("]", pos):
                return Scan(tuple(calls), complete=_ws(text, pos + 1) == len(text),
                            broken=_ws(text, pos + 1) != len(text))
            elif pos < len(text):
                return Scan(tuple(calls), broken=True)


def _mistral_v11(text: str, pos: int) -> Scan:
    """[TOOL_CALLS]NAME[ARGS]{...}, repeated."""
    calls: list[Partial] = []
    while True:
        a = text.find("[ARGS]", pos)
        if a < 0:
            return Scan(tuple(calls))
        name = text[pos:a].strip()
        got = _json_value(text, a + len("[ARGS]"))
        if got is None:
            return Scan(tuple(calls), broken=True)
        args, end = got
        if end is None:
            return Scan((*calls, Partial(name, args)))
        calls.append(Partial(name, args, True))
        pos = _ws(text, end)
        if pos == len(text):
            return Scan(tuple(calls), complete=True)
        if not text.startswith("[TOOL_CALLS]", pos):
            return Scan(tuple(calls), broken=_prefix_of(text, pos, "[TOOL_CALLS]") == "no")
        pos += len("[TOOL_CALLS]")


def _json_value(text: str, pos: int) -> tuple[str, int | None] | None:
    """An object's JSON text from text[pos:]: (its text so far, None) while open, (text, end) once
    whole; None when it is not an object."""
    pos = _ws(text, pos)
    if pos == len(text):
        return "", None
    if text[pos] != "{":
        return None
    depth, in_str, esc = 0, False, False
    for i in range(pos, len(text)):
        ch = text[i]
        if in_str:
            esc = not esc and ch == "\\"
            if ch == '"' and not esc:
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return text[pos:i + 1], i + 1
    return text[pos:], None


class DeepSeek(ToolFormat):
    """DeepSeek V3 / R1 (`function<｜tool▁sep｜>NAME` and a ```json block) or V3.1 and later
    (`NAME<｜tool▁sep｜>` and the JSON); its templates read the arguments as JSON text."""

    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    openers = (BEGIN,)
    text_arguments = True

    def __init__(self, v31: bool):
        self.v31 = v31
        self.name = "deepseek_v31" if v31 else "deepseek_r1"

    def detect(self, source: str) -> bool:
        if self.SEP not in source:
            return False
        v31 = f"'{self.SEP}' + tool['function']['arguments']" in source
        return v31 == self.v31

    def _one(self, name: str, args: str) -> str:
        if self.v31:
            return f"{self.CALL}{name}{self.SEP}{args}{self.CALL_END}"
        return f"{self.CALL}function{self.SEP}{name}\n```json\n{args}\n```{self.CALL_END}"

    def render(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        sep = "" if self.v31 else "\n"
        return self.BEGIN + sep.join(self._one(n, json.dumps(a, ensure_ascii=False)) for n, a in calls) + self.END

    def calls_rule(self, parallel: bool) -> str:
        sep = "" if self.v31 else "\\n"
        more = f' ("{sep}" call)*' if parallel else ""
        return f"calls: {lark_str(self.BEGIN)} call{more} {lark_str(self.END)}"

    def call_rules(self, tool: Tool, i: int) -> list[str]:
        head, tail = self._one(tool.name, "\x00").split("\x00")
        return [f"call_{i}: {lark_str(head)} args_{i} {lark_str(tail)}",
                f"args_{i}: {_json_rule(_closed(tool.parameters))}"]

    def scan(self, text: str, tools: Mapping[str, Tool]) -> Scan:
        pos = _ws(text, 0)
        state = _prefix_of(text, pos, self.BEGIN)
        if state != "yes":
            return Scan((), broken=state == "no")
        pos += len(self.BEGIN)
        calls: list[Partial] = []
        while True:
            pos = _ws(text, pos)
            if pos == len(text):
                return Scan(tuple(calls))
            if text.startswith(self.END, pos):
                return Scan(tuple(calls), complete=_ws(text, pos + len(self.END)) == len(text))
            state = _prefix_of(text, pos, self.CALL)
            if state != "yes":
                maybe_end = _prefix_of(text, pos, self.END) == "maybe"
                return Scan(tuple(calls), broken=state == "no" and not maybe_end)
            pos += len(self.CALL)
            s = text.find(self.SEP, pos)
            if s < 0:
                return Scan(tuple(calls))
            head = text[pos:s]
            pos = s + len(self.SEP)
            if head.strip() in ("function", ""):  # R1's: the name on the rest of the line, then ```json
                nl = text.find("\n", pos)
                if nl < 0:
                    return Scan(tuple(calls))
                name = text[pos:nl].strip()
                fence = re.compile(r"\s*```(?:json)?\s*").match(text, nl)
                if fence is None or fence.end() == len(text):
                    return Scan((*calls, Partial(name)))
                pos = fence.end()
            else:
                name = head.strip()
            got = _json_value(text, pos)
            if got is None:
                return Scan(tuple(calls), broken=True)
            args, end = got
            if end is None:
                return Scan((*calls, Partial(name, args)))
            pos = _ws(text, end)
            for tail in (("```" + self.CALL_END, self.CALL_END) if not self.v31 else (self.CALL_END,)):
                state = _prefix_of(text, pos, tail)
                if state != "no":
                    break
            if state != "yes":
                return Scan((*calls, Partial(name, args)), broken=state == "no")
            pos += len(tail)
            calls.append(Partial(name, args, True))


# ---- the registry ------------------------------------------------------------------------------

# detection order: the more specific marks first (Qwen3-Coder's and GLM's calls open with Hermes's tag)
_DETECTED: tuple[ToolFormat, ...] = (Qwen3Coder(), Glm45(), DeepSeek(v31=True), DeepSeek(v31=False),
                                     Mistral(v11=True), Mistral(v11=False), Llama3())
_BY_NAME = {f.name: f for f in _DETECTED}


def by_name(name: str) -> ToolFormat | None:
    """The format called `name`; None for hermes (edgespec.tools' own); KeyError when unknown."""
    if name == "hermes":
        return None
    return _BY_NAME[name]


def detect(source: str) -> str | None:
    """The call format a chat template's text writes: a name in FORMATS, or None when it shows none."""
    for f in _DETECTED:
        if f.detect(source):
            return f.name
    return "hermes" if "<tool_call>" in source else None
