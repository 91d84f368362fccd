"""Tool calling (OpenAI's `tools`): the request's tools and tool_choice, the grammar that keeps
the model's answer to "text, or calls whose arguments validate", the conversation's tool turns as
the chat template sees them, and the answer parsed back into calls (whole, or as a stream).

The wire format the model writes is edgespec's (the Hermes / Qwen format, which many chat
templates already use):

    <tool_call>
    {"name":"get_weather","arguments":{"city":"Paris"}}
    </tool_call>

one block per call, blocks separated by a newline. A chat template that writes calls in another
family's format (Qwen3-Coder's XML, GLM's, Llama 3's JSON, Mistral's, DeepSeek's: tool_formats.py)
gets that format instead (`ToolSpec.format`, from format_for): its grammar, its parser, its
stream, and its spelling of the history's calls. The answer is constrained (edgespec/constraint.py,
a Lark grammar with each call's JSON following its tool's schema), so every call parses and its
arguments validate, in every speculative mode, with the masked distribution preserved exactly as
for response_format. tool_choice:

    auto       text that does not begin with "<tool_call>", or one or more calls
    none       text that does not begin with "<tool_call>" (the tools are still shown)
    required   one or more calls (one when parallel_tool_calls is false)
    {function} one call of that function

Pure: no I/O, no engine.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edgespec import tool_formats
from edgespec.call_reader import CallReader
from edgespec.errors import BadRequest
from edgespec.tool_formats import EMPTY_PARAMETERS
from edgespec.tool_formats import Tool as Tool  # re-exported: edgespec.tools.Tool is the name callers use
from edgespec.types import ConstraintSpec

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and how it lets the model use them."""

    tools: tuple[Tool, ...]
    choice: str = "auto"  # auto | none | required | function:<name>
    parallel: bool = True
    format: str = "hermes"  # the call format the model writes (tool_formats.FORMATS)

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none"

    @property
    def by_name(self) -> dict[str, Tool]:
        return {t.name: t for t in self.tools}

    def grammar(self, not_text: Sequence[str] = ()) -> str:
        """The Lark grammar (llguidance's dialect) the answer must match. Text (auto, none) begins
        with none of the calls' openings, nor with `not_text` (leading whitespace aside)."""
        if self.choice.startswith("function:"):
            tools = [t for t in self.tools if t.name == self.choice.removeprefix("function:")]
        else:
            tools = list(self.tools)
        fmt = tool_formats.by_name(self.format)
        if fmt is not None:
            return fmt.grammar(tools, self.choice, self.parallel, not_text)
        schema: dict[str, Any] = {"x-guidance": {"whitespace_flexible": False},
                                  "anyOf": [_call_schema(t) for t in tools]}
        one = f'"{_lark(OPEN)}\\n" call_body "\\n{_lark(CLOSE)}"'
        calls = "call" if not self.parallel or self.choice.startswith("function:") else 'call ("\\n" call)*'
        text = "TEXT: /(.|\\n)*/ & ~/[ \\t\\r\\n]*(" + "|".join(_regex(o) for o in (OPEN, *not_text)) + ")(.|\\n)*/"
        if self.choice == "none":
            return f"start: TEXT\n{text}\n"
        start = "calls" if self.choice != "auto" else "TEXT | calls"
        return (f"start: {start}\ncalls: {calls}\ncall: {one}\n{text}\n"
                f"call_body: %json {json.dumps(schema)}\n")

    def constraint(self, not_text: Sequence[str] = ()) -> ConstraintSpec:
        return ConstraintSpec("lark", self.grammar(not_text))

    def parse(self, text: str, *, truncated: bool = False) -> tuple[str | None, tuple[ToolCall, ...]]:
        """The answer as (content, calls) in this spec's format (parse_answer's contract)."""
        fmt = tool_formats.by_name(self.format)
        if fmt is None:
            return parse_answer(text, truncated=truncated)
        return parse_format(fmt, text, self.by_name, truncated=truncated)

    def stream(self) -> AnswerStream | FormatStream:
        """A reader of the answer as it streams, in this spec's format."""
        fmt = tool_formats.by_name(self.format)
        return AnswerStream() if fmt is None else FormatStream(fmt, self.by_name)


def _call_schema(t: Tool) -> dict:
    """One call's JSON: {"name": <the tool>, "arguments": <its parameters>}. Arguments whose schema
    names properties but says nothing of others are closed (additionalProperties false), as
    llama.cpp's grammar converter does: a tool reads only what it declares, and a small model
    left free to add keys may add them until max_tokens."""
    params = dict(t.parameters)
    if "properties" in params and "additionalProperties" not in params:
        params["additionalProperties"] = False
    return {"type": "object", "properties": {"name": {"const": t.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _lark(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def _regex(s: str) -> str:
    return re.sub(r"([\\/.*+?()\[\]{}|^$])", r"\\\1", s)


# ---- the request's fields ----------------------------------------------------------------------


def parse_tools(tools: Any, tool_choice: Any, parallel: Any, format: str = "hermes") -> ToolSpec | None:
    """OpenAI's tools / tool_choice / parallel_tool_calls; None when the request has no tools
    (tool_choice none or absent). BadRequest names the field. `format`: the call format the
    model writes (format_for)."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise BadRequest("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools", "must be a list of {type: function, function: {name, parameters}}")
    if len(tools) > MAX_TOOLS:
        raise BadRequest("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        out.append(_tool(t, f"tools[{i}]"))
    names = [t.name for t in out]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise BadRequest(f"tools[{i}].function.name", f"duplicate tool name {n!r}")
    if (bad := tool_formats.check_strings(tool_formats.by_name(format), out)) is not None:
        raise BadRequest(*bad)
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls", f"must be true or false, got {parallel!r}")
    return ToolSpec(tuple(out), _choice(tool_choice, names), True if parallel is None else parallel, format)


def _tool(t: Any, where: str) -> Tool:
    if not isinstance(t, Mapping) or t.get("type") != "function":
        raise BadRequest(f"{where}.type", "must be 'function'")
    f = t.get("function")
    if not isinstance(f, Mapping):
        raise BadRequest(f"{where}.function", "must be an object with name and parameters")
    for k in f:
        if k not in ("name", "description", "parameters", "strict"):
            raise BadRequest(f"{where}.function.{k}", "unknown field")
    name = f.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadRequest(f"{where}.function.name", f"must be 1-64 letters, digits, _ . or -, got {name!r}")
    desc = f.get("description") or ""
    if not isinstance(desc, str):
        raise BadRequest(f"{where}.function.description", "must be a string")
    params = f.get("parameters")
    if params is None:
        params = dict(EMPTY_PARAMETERS)
    if not isinstance(params, Mapping):
        raise BadRequest(f"{where}.function.parameters", "must be a JSON schema object")
    if params.get("type", "object") != "object":
        raise BadRequest(f"{where}.function.parameters.type", f"must be 'object', got {params.get('type')!r}")
    return Tool(name, desc, dict(params))


def _choice(v: Any, names: Sequence[str]) -> str:
    if v is None:
        return "auto"
    if v in ("auto", "none", "required"):
        return v
    if isinstance(v, Mapping) and v.get("type") == "function" and isinstance(v.get("function"), Mapping):
        name = v["function"].get("name")
        if name not in names:
            raise BadRequest("tool_choice.function.name", f"no tool named {name!r} (tools: {', '.join(names)})")
        return f"function:{name}"
    raise BadRequest("tool_choice", "must be auto, none, required or {type: function, function: {name}}")


def parse_history_calls(v: Any, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's tool_calls (arguments must be JSON text)."""
    if not isinstance(v, list):
        raise BadRequest(where, "must be a list of {id, type: function, function: {name, arguments}}")
    out = []
    for j, c in enumerate(v):
        w = f"{where}[{j}]"
        if not isinstance(c, Mapping) or c.get("type", "function") != "function":
            raise BadRequest(f"{w}.type", "must be 'function'")
        f = c.get("function")
        if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
            raise BadRequest(f"{w}.function", "must be an object with name and arguments")
        args = f.get("arguments", "{}")
        if not isinstance(args, str):
            raise BadRequest(f"{w}.function.arguments", "must be a JSON string")
        try:
            json.loads(args)
        except ValueError:
            raise BadRequest(f"{w}.function.arguments", "must be valid JSON text") from None
        cid = c.get("id") or ""
        if not isinstance(cid, str):
            raise BadRequest(f"{w}.id", "must be a string")
        out.append(ToolCall(cid, f["name"], args))
    return tuple(out)


# ---- the conversation as the template sees it --------------------------------------------------


def system_text(spec: ToolSpec, fmt: tool_formats.ToolFormat | None = None) -> str:
    """The tools, described for a template that has no tools of its own (edgespec's format, or
    `fmt`'s, shown by an example call)."""
    lines = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in spec.tools)
    head = ("You can call functions. They are described, one JSON object per line, inside <tools></tools>:\n"
            f"<tools>\n{lines}\n</tools>\n")
    if fmt is not None:
        example = fmt.render([("<function name>", {"<argument name>": "<value>"})])
        return head + f"To call a function, answer with the call alone, written like this:\n{example}\n" \
            "A function's result comes back in a message of role tool."
    return (head + "To call a function, answer with a JSON object inside <tool_call></tool_call> tags, one per call:\n"
            f'{OPEN}\n{{"name":"<function name>","arguments":{{<arguments>}}}}\n{CLOSE}\n'
            "A function's result comes back in a message of role tool.")


def calls_text(calls: Sequence[ToolCall], fmt: tool_formats.ToolFormat | None = None) -> str:
    """Calls as the model writes them (an assistant turn of the history, edgespec's format or `fmt`'s)."""
    if fmt is not None:
        return fmt.render([(c.name, json.loads(c.arguments)) for c in calls])
    return "\n".join(f'{OPEN}\n{{"name":{json.dumps(c.name, ensure_ascii=False)},"arguments":'
                     f'{json.dumps(json.loads(c.arguments), ensure_ascii=False, separators=(",", ":"))}}}\n{CLOSE}'
                     for c in calls)


# ---- the answer --------------------------------------------------------------------------------

_BLOCK = re.compile(re.escape(OPEN) + r"\n(.*?)\n" + re.escape(CLOSE), re.S)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(body: str, call_id: str | None = None) -> ToolCall | None:
    """A call block's JSON as a ToolCall, or None when it is not {"name": <string>, "arguments": ...}.
    Its arguments are the JSON text as the model wrote it (as CallReader reads it while it
    streams), so that a streamed call's argument fragments concatenate to them."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    reader = CallReader()
    reader.feed(body)
    args = reader.arguments if reader.arguments_done and not reader.broken else \
        json.dumps(obj["arguments"], ensure_ascii=False)
    return ToolCall(call_id or new_call_id(), obj["name"], args)


def parse_answer(text: str, *, truncated: bool = False) -> tuple[str | None, tuple[ToolCall, ...]]:
    """(content, calls): calls when the answer is one or more complete call blocks, else the
    text as content. `truncated` (max_tokens ended it): the complete calls before a call cut
    short are kept (the stream sent them too); a first call cut short stays text."""
    if not text.startswith(OPEN):
        return text, ()
    calls = []
    pos = 0
    for m in _BLOCK.finditer(text):
        if text[pos:m.start()].strip():
            return text, ()
        c = _call(m.group(1))
        if c is None:
            return text, ()
        calls.append(c)
        pos = m.end()
    rest = text[pos:].strip()
    if not calls or (rest and not (truncated and (rest.startswith(OPEN) or OPEN.startswith(rest)))):
        return text, ()
    return None, tuple(calls)


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call: its header first (id and name set, no arguments), then
    fragments of its arguments' JSON text (id and name None); `index`: the call's place."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class AnswerStream:
    """The answer's text as it streams -> ("content", text) and ("call", CallDelta) events.
    Text that might still become a call's opening tag is held back until it cannot; a call's
    header goes out as soon as its name is read, its arguments as they are written (only what
    belongs to the arguments value: the closing brace and tag never). `calls`: the calls
    completed so far (their arguments equal the concatenated fragments)."""

    def __init__(self) -> None:
        self._mode = "undecided"  # -> text | calls
        self._buf = ""  # undecided: the text so far; calls: text between blocks (a tag's beginning)
        self._block: list[str] | None = None  # the open block's text after "<tool_call>\n"; None: between blocks
        self._tail = ""  # the open block's last characters (a closing tag may begin in them)
        self._reader = CallReader()
        self._id = ""
        self._head = False  # the open block's header was sent
        self._heads = 0  # headers sent (the next call's index)
        self._held: list[str] = []  # the text while no call has been sent (content, should no call come of it)
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if self._mode == "text":
            return [("content", text)] if text else []
        if self._mode == "undecided":
            self._buf += text
            if OPEN.startswith(self._buf):
                return []
            if not self._buf.startswith(OPEN):
                self._mode = "text"
                content, self._buf = self._buf, ""
                return [("content", content)]
            self._mode = "calls"
            text, self._buf = self._buf, ""
        if not self._heads:
            self._held.append(text)
        out: list[tuple[str, Any]] = []
        while text:
            if self._block is None:  # between blocks: look for the next opening tag
                self._buf += text
                i = self._buf.find(OPEN + "\n")
                if i < 0:
                    self._buf = self._buf[-len(OPEN):]
                    break
                text, self._buf = self._buf[i + len(OPEN) + 1:], ""
                self._block, self._tail, self._reader, self._id, self._head = [], "", CallReader(), new_call_id(), False
                continue
            window = self._tail + text
            j = window.find("\n" + CLOSE)
            if j < 0:
                self._block.append(text)
                self._reader.feed(text)
                self._tail = window[-len(CLOSE):]
                out += self._deltas()
                break
            cut = j - len(self._tail)  # where the block ends in `text` (< 0: in what came before)
            self._block.append(text[:max(cut, 0)])
            self._reader.feed(text[:max(cut, 0)])
            body = "".join(self._block)
            body = body[:cut] if cut < 0 else body
            out += self._deltas()
            text = text[cut + len(CLOSE) + 1:]
            call = _call(body, self._id)
            if call is not None:
                if not self._head:  # read only whole (a shape the reader gave up on): sent whole
                    out += [("call", CallDelta(self._heads, call.id, call.name)),
                            ("call", CallDelta(self._heads, arguments=call.arguments))]
                    self._heads += 1
                self.calls.append(call)
            self._block = None
        return out

    def _deltas(self) -> list[tuple[str, Any]]:
        r = self._reader
        if r.broken or r.name is None:
            return []
        out: list[tuple[str, Any]] = []
        if not self._head:
            out.append(("call", CallDelta(self._heads, self._id, r.name)))
            self._head = True
            self._heads += 1
            self._held = []
        fragment = r.take()
        if fragment:
            out.append(("call", CallDelta(self._heads - 1, arguments=fragment)))
        return out

    def finish(self) -> list[tuple[str, Any]]:
        """What is left: held-back text (no call came of it) as content. A call cut short (max_tokens)
        keeps what was sent of it."""
        if self._mode == "calls":
            rest, self._held = "".join(self._held), []
            return [("content", rest)] if rest.strip() and not self._heads else []
        rest, self._buf = self._buf, ""
        return [("content", rest)] if rest else []


def _whole_calls(scan: tool_formats.Scan, ids: Sequence[str] = ()) -> list[ToolCall] | None:
    """The scan's whole calls as ToolCalls (ids in order, new ones past them); None when one's
    arguments are not a JSON object."""
    out = []
    for k, c in enumerate(scan.calls):
        if not c.done:
            break
        try:
            ok = isinstance(json.loads(c.arguments), dict)
        except ValueError:
            ok = False
        if not ok or c.name is None:
            return None
        out.append(ToolCall(ids[k] if k < len(ids) else new_call_id(), c.name, c.arguments))
    return out


def _opens(fmt: tool_formats.ToolFormat, text: str) -> str:
    """'yes' when the text (leading whitespace aside) opens the format's calls, 'maybe' while it may still."""
    s = text.lstrip()
    if any(s.startswith(o) for o in fmt.openers):
        return "yes"
    return "maybe" if any(o.startswith(s) for o in fmt.openers) else "no"


def parse_format(fmt: tool_formats.ToolFormat, text: str, tools: Mapping[str, Tool], *,
                 truncated: bool = False) -> tuple[str | None, tuple[ToolCall, ...]]:
    """parse_answer for another family's format: calls when the answer is nothing but whole calls
    (`truncated`: whole calls before one cut short), else the text as content."""
    if _opens(fmt, text) != "yes":
        return text, ()
    scan = fmt.scan(text, tools)
    calls = _whole_calls(scan)
    if scan.broken or not calls or not (scan.complete or truncated):
        return text, ()
    return None, tuple(calls)


class FormatStream:
    """AnswerStream for another family's format: text held back while it may still open a call,
    then each call's header once its name is read and its arguments' JSON text as the format's
    scan extends it. A scan reads the whole answer so far, so it runs once the answer has grown
    by a sixteenth since the last (every feed while it is short): linear in the answer's length,
    a long argument streamed in pieces of a sixteenth of the answer."""

    def __init__(self, fmt: tool_formats.ToolFormat, tools: Mapping[str, Tool]):
        self.fmt, self.tools = fmt, tools
        self._mode = "undecided"  # -> text | calls
        self._buf = ""
        self._ids: list[str] = []  # the headers sent
        self._sent: list[str] = []  # each call's arguments sent
        self._scanned = 0  # the answer's length at the last scan
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if self._mode == "text":
            return [("content", text)] if text else []
        self._buf += text
        if self._mode == "undecided":
            opens = _opens(self.fmt, self._buf)
            if opens == "maybe":
                return []
            if opens == "no":
                self._mode = "text"
                out, self._buf = self._buf, ""
                return [("content", out)]
            self._mode = "calls"
        if len(self._buf) - self._scanned < len(self._buf) // 16:
            return []
        return self._deltas()

    def _deltas(self) -> list[tuple[str, Any]]:
        self._scanned = len(self._buf)
        scan = self.fmt.scan(self._buf, self.tools)
        out: list[tuple[str, Any]] = []
        for k, c in enumerate(scan.calls):
            if c.name is None:
                break
            if k == len(self._ids):
                self._ids.append(new_call_id())
                self._sent.append("")
                out.append(("call", CallDelta(k, self._ids[k], c.name)))
            sent = self._sent[k]
            if len(c.arguments) > len(sent) and c.arguments.startswith(sent):
                out.append(("call", CallDelta(k, arguments=c.arguments[len(sent):])))
                self._sent[k] = c.arguments
        return out

    def finish(self) -> list[tuple[str, Any]]:
        """What is left: held-back text (no call came of it) as content; the whole calls in `calls`."""
        if self._mode == "calls":
            out = self._deltas()  # what the last feeds left unscanned
            self.calls = _whole_calls(self.fmt.scan(self._buf, self.tools), self._ids) or []
            if out:
                return out
            if not self._ids:
                rest, self._buf = self._buf, ""
                return [("content", rest)] if rest.strip() else []
            return []
        rest, self._buf = self._buf, ""
        return [("content", rest)] if rest else []


def format_for(template: Any, forced: str = "auto") -> str:
    """The call format for a chat template: `forced` ([target] tool_format) unless auto, else the
    one its text writes (tool_formats.detect), else edgespec's (hermes)."""
    if forced != "auto":
        return forced
    if template is None:
        return "hermes"
    return tool_formats.detect(template.source) or "hermes"


def call_format(tok: Any, override: str = "", forced: str = "auto") -> str:
    """format_for the template a request is rendered with (the GGUF's own unless `override`, as
    encode_request renders it); edgespec's without a tokenizer."""
    if forced != "auto" or tok is None:
        return forced if forced != "auto" else "hermes"
    from edgespec import chat

    return format_for(chat.template_of(tok, override or None))


def native(template: Any) -> bool:
    """Whether a chat template shows tools and writes calls itself (it mentions `tools` and writes
    calls in a format tool_formats knows)."""
    return template is not None and getattr(template, "has_tools", False) and \
        tool_formats.detect(template.source) is not None


def template_inputs(messages: Sequence[tuple[str, str]], extras: Sequence[Mapping[str, Any]],
                    spec: ToolSpec | None, template: Any
                    ) -> tuple[tuple[tuple[str, str], ...], tuple[dict, ...] | None, list[dict] | None]:
    """(messages, extras, tools) for chat.encode_chat. A template that shows tools itself
    (`native`) gets them as the `tools` variable and each assistant turn's calls as tool_calls
    (arguments as objects, as Hugging Face templates read them), and each its reasoning_content.
    Otherwise edgespec's format:
    the tools described in the (first) system message, and each assistant turn's calls written
    into its content as the model writes them; every piece of it is then content (tokenised as
    text, never as control tokens)."""
    extras = list(extras) or [{} for _ in messages]
    fmt = tool_formats.by_name(spec.format if spec is not None else format_for(template))
    # an assistant turn's reasoning, for a template that shows it (Qwen3's and GLM's, after the
    # last user turn); a template that does not read reasoning_content drops it
    thoughts = [{"reasoning_content": e["reasoning_content"]} if e.get("reasoning_content") else {} for e in extras]
    if native(template):
        as_text = fmt is not None and fmt.text_arguments
        ex = []
        for e, thought in zip(extras, thoughts):
            d: dict[str, Any] = dict(thought)
            if e.get("tool_calls"):
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": c.arguments if as_text else json.loads(c.arguments)}}
                    for c in e["tool_calls"]]
            if e.get("tool_call_id"):
                d["tool_call_id"] = e["tool_call_id"]
            ex.append(d)
        tools = [t.as_openai() for t in spec.tools] if spec is not None else None
        return tuple(messages), tuple(ex), tools
    out = []
    for (role, content), e in zip(messages, extras):
        if e.get("tool_calls"):
            content = (content + "\n" if content else "") + calls_text(e["tool_calls"], fmt)
        out.append((role, content))
    if spec is not None:
        head = system_text(spec, fmt)
        if out and out[0][0] == "system":
            out[0] = ("system", head + ("\n\n" + out[0][1] if out[0][1] else ""))
        else:
            out.insert(0, ("system", head))
            thoughts.insert(0, {})
    return tuple(out), (tuple(thoughts) if any(thoughts) else None), None


def encode_request(tok: Any, prompt: str, messages: Sequence[tuple[str, str]], extras: Sequence[Mapping[str, Any]],
                   spec: ToolSpec | None, override: str = "", *, variables: Mapping[str, Any] | None = None,
                   jinja: bool = False, rendered: list[str] | None = None) -> list[int]:
    """A chat or text request's prompt token ids. A chat request with tools, tool turns, template
    `variables` (enable_thinking, reasoning_effort), `jinja` (a reasoning model's: its prompt's
    end is read) or a configured template (`override`, [target] chat_template) renders the Jinja
    template (the GGUF's own unless overridden) through template_inputs, its text appended to
    `rendered`; the others render the GGUF's own template through the tokenizer (chat.encode_prompt)."""
    from edgespec import chat

    if not messages or (spec is None and not extras and not override and not variables and not jinja):
        return chat.encode_prompt(tok, prompt, messages)
    template = chat.template_of(tok, override or None)
    msgs, ex, tools = template_inputs(messages, extras, spec, template)
    return chat.encode_chat(tok, msgs, template=template, tools=tools, extras=ex, variables=variables,
                            rendered=rendered)
