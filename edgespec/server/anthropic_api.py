"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the one
chat pipeline: a Messages body is translated into the OpenAI chat body openai_api validates, and
the answer (its result, or its stream's events: edgespec.server.answer) is translated back into
Anthropic's message and event shapes. Pure: no I/O, no server, no engine.

What maps to what:

    system (a string, or text blocks)       the first message, role system
    messages[i] text blocks                 one message of the same role (blocks joined by a blank line)
    an assistant turn's tool_use blocks     its tool_calls (input -> arguments' JSON text)
    a user turn's tool_result blocks        one tool message each (tool_use_id -> tool_call_id;
                                            is_error: the content after "Error: ")
    an assistant turn's thinking blocks     its reasoning_content, shown as the chat template shows
                                            earlier reasoning (Qwen3's and GLM's: after the last user
                                            turn; before it, and in other templates, dropped)
    redacted_thinking blocks                dropped
    tools [{name, description, input_schema}]   function tools (grammar-constrained calls)
    tool_choice auto / any / tool / none    auto / required / that function / none;
                                            disable_parallel_tool_use -> parallel_tool_calls false
    output_config.format (json_schema)      response_format json_schema (the answer follows the schema)
    stop_sequences, max_tokens (required), temperature, top_p, top_k, stream, edgespec: as named
    ignore_eos (llama-server's extension)   ignore_eos: runs to max_tokens
    thinking {type: enabled / disabled}     chat_template_kwargs enable_thinking; the reasoning of a
                                            thinking model comes back as a thinking block
    thinking.budget_tokens                  the <think> block's budget (edgespec.reasoning_budget:
                                            closed by force once spent, edgespec/budget.py)
    metadata, service_tier, cache_control, output_config.effort, speed, inference_geo,
    diagnostics, user_profile_id, workspace_id: accepted and ignored

stop_reason: end_turn (end of sequence), stop_sequence (with the string), max_tokens, tool_use.
A field error names Anthropic's field (`stop_sequences`, `tools[0].input_schema`, ...), in
Anthropic's error body {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from edgespec.errors import BadRequest
from edgespec.server import answer
from edgespec.server.fields import FieldNames
from edgespec.tools import ToolCall

# fields the Messages API defines that we accept: translated, or ignored (_IGNORED)
_IGNORED = ("metadata", "thinking", "service_tier", "cache_control", "speed", "inference_geo", "diagnostics",
            "user_profile_id", "workspace_id")
_KNOWN = {"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k",
          "tools", "tool_choice", "output_config", "edgespec", "ignore_eos", *_IGNORED}
_COUNT_KNOWN = {"model", "messages", "system", "tools", "tool_choice", "output_config", *_IGNORED}
STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use"}
# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 504: "timeout_error"}


def to_chat(body: Any, *, strict: bool, count: bool = False) -> tuple[dict, tuple[str, ...], list[int]]:
    """(the OpenAI chat body, the unknown fields ignored, per chat message the index of the
    Messages message it came from (-1: the system prompt)). `count`: a count_tokens body (no
    max_tokens, no sampling). BadRequest names the Messages field; unknown fields are refused
    when `strict`, else ignored and returned."""
    if not isinstance(body, Mapping):
        raise BadRequest("body", "must be a JSON object")
    known = _COUNT_KNOWN if count else _KNOWN
    unknown = tuple(str(k) for k in body if k not in known)
    if unknown and strict:
        raise BadRequest(unknown[0], "unknown field ([http] strict = true)")
    if not count and body.get("max_tokens") is None:
        raise BadRequest("max_tokens", "is required")
    messages, origin = _messages(body.get("system"), body.get("messages"))
    chat: dict[str, Any] = {"messages": messages}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    if not count:
        for k in ("max_tokens", "temperature", "top_p", "top_k", "stream", "edgespec", "ignore_eos"):
            if body.get(k) is not None:
                chat[k] = body[k]
        if body.get("stop_sequences") is not None:
            if not isinstance(body["stop_sequences"], list):
                raise BadRequest("stop_sequences", "must be a list of strings")
            chat["stop"] = body["stop_sequences"]
        if body.get("stream") is True:
            chat["stream_options"] = {"include_usage": True}
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"]))
    if not count and (fmt := _output_format(body.get("output_config"))) is not None:
        chat["response_format"] = fmt
    enable, budget = _thinking(body.get("thinking"))
    if enable is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": enable}
    if budget is not None and not count:
        ext = chat.get("edgespec")
        chat["edgespec"] = {**(ext if isinstance(ext, Mapping) else {}), "reasoning_budget": budget}
    return chat, unknown, origin


def _thinking(v: Any) -> tuple[bool | None, int | None]:
    """thinking {type: enabled | disabled | adaptive, budget_tokens} as (the template's
    enable_thinking, None: leave the template's default; the reasoning budget, edgespec/budget.py)."""
    if v is None:
        return None, None
    if not isinstance(v, Mapping) or v.get("type") not in ("enabled", "disabled", "adaptive"):
        raise BadRequest("thinking.type", "must be 'enabled', 'disabled' or 'adaptive'")
    budget = v.get("budget_tokens")
    if v["type"] == "enabled" and budget is not None:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise BadRequest("thinking.budget_tokens", f"must be an integer >= 1, got {budget!r}")
    else:
        budget = None
    return (None if v["type"] == "adaptive" else v["type"] == "enabled"), budget


def _output_format(v: Any) -> dict | None:
    """output_config.format {type: json_schema, schema} as OpenAI's response_format (effort is ignored)."""
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise BadRequest("output_config", "must be an object {format, effort}")
    fmt = v.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
        raise BadRequest("output_config.format.type", "must be 'json_schema'")
    return {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}


def _text(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise BadRequest(where, f"must be a string, got {type(v).__name__}")
    return v


def _system(v: Any) -> str:
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise BadRequest("system", "must be a string or a list of text blocks")
    out = []
    for j, b in enumerate(v):
        if not isinstance(b, Mapping) or b.get("type") != "text":
            raise BadRequest(f"system[{j}].type", "must be 'text'")
        out.append(_text(b.get("text"), f"system[{j}].text"))
    return "\n\n".join(out)


def _messages(system: Any, v: Any) -> tuple[list[dict], list[int]]:
    if not isinstance(v, list) or not v:
        raise BadRequest("messages", "must be a non-empty list of {role, content} objects")
    out: list[dict] = []
    origin: list[int] = []
    if system is not None and (text := _system(system)):
        out.append({"role": "system", "content": text})
        origin.append(-1)
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise BadRequest(where, "must be an object with role and content")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise BadRequest(f"{where}.role", f"must be user or assistant, got {role!r}")
        content = m.get("content")
        if isinstance(content, str):
            turns = [{"role": role, "content": content}]
        elif isinstance(content, list):
            turns = _assistant(content, where) if role == "assistant" else _user(content, where)
        else:
            raise BadRequest(f"{where}.content", "must be a string or a list of content blocks")
        out += turns
        origin += [i] * len(turns)
    return out, origin


def _block(b: Any, where: str, kinds: Sequence[str]) -> str:
    kind = b.get("type") if isinstance(b, Mapping) else None
    if kind not in kinds:
        shown = kind if kind is not None else type(b).__name__
        raise BadRequest(f"{where}.type", f"must be one of {', '.join(kinds)}, got {shown!r}")
    return str(kind)


def _user(blocks: list, where: str) -> list[dict]:
    """A user turn's blocks: each tool_result a tool message, runs of text blocks a user message."""
    out: list[dict] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        w = f"{where}.content[{j}]"
        if _block(b, w, ("text", "tool_result")) == "text":
            texts.append(_text(b.get("text"), f"{w}.text"))
            continue
        if texts:
            out.append({"role": "user", "content": "\n\n".join(texts)})
            texts = []
        out.append({"role": "tool", "tool_call_id": _text(b.get("tool_use_id"), f"{w}.tool_use_id"),
                    "content": ("Error: " if b.get("is_error") is True else "") + _result(b.get("content"), w)})
    if texts or not out:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _result(v: Any, where: str) -> str:
    """A tool_result's content: a string or text blocks."""
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise BadRequest(f"{where}.content", "must be a string or a list of text blocks")
    out = []
    for k, b in enumerate(v):
        _block(b, f"{where}.content[{k}]", ("text",))
        out.append(_text(b.get("text"), f"{where}.content[{k}].text"))
    return "\n\n".join(out)


def _assistant(blocks: list, where: str) -> list[dict]:
    """An assistant turn's blocks: its text, its tool_use blocks as tool_calls, its thinking as
    reasoning_content."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict] = []
    for j, b in enumerate(blocks):
        w = f"{where}.content[{j}]"
        kind = _block(b, w, ("text", "tool_use", "thinking", "redacted_thinking"))
        if kind == "text":
            texts.append(_text(b.get("text"), f"{w}.text"))
        elif kind == "thinking":
            thoughts.append(_text(b.get("thinking"), f"{w}.thinking"))
        elif kind == "tool_use":
            args = b.get("input", {})
            if not isinstance(args, Mapping):
                raise BadRequest(f"{w}.input", "must be an object")
            calls.append({"id": _text(b.get("id", ""), f"{w}.id"), "type": "function",
                          "function": {"name": _text(b.get("name"), f"{w}.name"),
                                       "arguments": json.dumps(args, ensure_ascii=False)}})
    turn: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    if thoughts:
        turn["reasoning_content"] = "\n\n".join(thoughts)
    return [turn]


def _tools(v: Any) -> Any:
    if not isinstance(v, list):
        raise BadRequest("tools", "must be a list of {name, description, input_schema}")
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, Mapping):
            raise BadRequest(f"tools[{i}]", "must be an object {name, description, input_schema}")
        if t.get("type") not in (None, "custom"):
            raise BadRequest(f"tools[{i}].type", f"only custom tools are supported, got {t.get('type')!r}")
        f: dict[str, Any] = {"name": t.get("name"), "parameters": t.get("input_schema")}
        if t.get("description") is not None:
            f["description"] = t["description"]
        out.append({"type": "function", "function": f})
    return out


def _tool_choice(v: Any) -> dict:
    if not isinstance(v, Mapping):
        raise BadRequest("tool_choice", "must be an object {type: auto | any | tool | none}")
    kind = v.get("type")
    choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None
    if kind == "tool":
        choice = {"type": "function", "function": {"name": v.get("name")}}
    elif choice is None:
        raise BadRequest("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}")
    out: dict[str, Any] = {"tool_choice": choice}
    dpt = v.get("disable_parallel_tool_use")
    if dpt is not None:
        if not isinstance(dpt, bool):
            raise BadRequest("tool_choice.disable_parallel_tool_use", f"must be true or false, got {dpt!r}")
        out["parallel_tool_calls"] = not dpt
    return out


_RENAMES = (
    (re.compile(r"^stop(?=\[|$)"), "stop_sequences"),
    (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"^tools\[(\d+)\]\.function\.(\w+)"), r"tools[\1].\2"),
    (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
    (re.compile(r"^parallel_tool_calls"), "tool_choice.disable_parallel_tool_use"),
    (re.compile(r"^max_completion_tokens"), "max_tokens"),
    (re.compile(r"^response_format\.json_schema"), "output_config.format"),
    (re.compile(r"^response_format"), "output_config.format"),
    (re.compile(r"^edgespec\.reasoning_budget"), "thinking.budget_tokens"),
)


# the chat body's fields as the Messages body names them
NAMES = FieldNames(_RENAMES, "system", "messages[{}].content")
renamed = NAMES.renamed


# ---- the answer --------------------------------------------------------------------------------


def stop_reason(finish: str) -> str:
    return STOP_REASONS.get(finish, "end_turn")


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic spells them (toolu_...)."""
    return "toolu_" + call_id.removeprefix("call_")


def message_body(*, rid: str, model: str, content: str | None, calls: Sequence[ToolCall], finish: str,
                 stop_sequence: str | None, input_tokens: int, output_tokens: int,
                 stats: Mapping[str, Any], thinking: str | None = None) -> dict:
    blocks: list[dict] = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []
    blocks += [{"type": "text", "text": content}] if content else []
    blocks += [{"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": json.loads(c.arguments)}
               for c in calls]
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": stop_reason(finish), "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}, "edgespec": dict(stats)}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _event(kind: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


class MessageStream:
    """Anthropic's event sequence for a streamed answer (edgespec.server.answer, one choice):
    message_start and a ping; per content block content_block_start, its deltas (text_delta, or
    a tool_use block's input_json_delta: its arguments' JSON text as the model writes it) and
    content_block_stop; then message_delta (stop_reason, stop_sequence, usage.output_tokens)
    and message_stop. A ping while the request waits; an error ends the stream with an `error`
    event."""

    def __init__(self, *, rid: str, model: str, input_tokens: int):
        self.rid, self.model, self.input_tokens = rid, model, input_tokens
        self.block = -1  # the open block's index (-1: none yet)
        self.open: str | None = None  # the open block's type, None: no block open
        self.ended: answer.End | None = None

    def start(self) -> bytes:
        message: dict[str, Any] = {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return _event("message_start", {"message": message}) + _event("ping", {})

    def _stop(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return _event("content_block_stop", {"index": self.block})

    def _begin(self, block: dict) -> bytes:
        out = self._stop()
        self.block += 1
        self.open = block["type"]
        return out + _event("content_block_start", {"index": self.block, "content_block": block})

    def event(self, ev: answer.Event) -> bytes:
        if isinstance(ev, answer.Reasoning):
            out = b"" if self.open == "thinking" else self._begin({"type": "thinking", "thinking": "",
                                                                   "signature": ""})
            return out + _event("content_block_delta", {"index": self.block,
                                                        "delta": {"type": "thinking_delta", "thinking": ev.text}})
        if isinstance(ev, answer.Text):
            out = b"" if self.open == "text" else self._begin({"type": "text", "text": ""})
            return out + _event("content_block_delta", {"index": self.block,
                                                        "delta": {"type": "text_delta", "text": ev.text}})
        if isinstance(ev, answer.Call):
            d = ev.delta
            if d.id is not None:
                return self._begin({"type": "tool_use", "id": tool_use_id(d.id), "name": d.name, "input": {}})
            return _event("content_block_delta", {"index": self.block,
                                                  "delta": {"type": "input_json_delta", "partial_json": d.arguments}})
        if isinstance(ev, answer.End):
            self.ended = ev
            return self._stop()
        if isinstance(ev, answer.Usage):
            end = self.ended
            delta = {"stop_reason": stop_reason(end.finish) if end else "end_turn",
                     "stop_sequence": end.stop_sequence if end else None}
            output = sum(len(r.token_ids) for r in ev.results)
            return _event("message_delta", {"delta": delta, "usage": {"output_tokens": output}}) + \
                _event("message_stop", {})
        return _event("ping", {})  # Waiting

    def error(self, status: int, message: str, openai_body: Mapping) -> bytes:
        return _event("error", {"error": error_body(status, message)["error"]})

    def end(self) -> bytes:
        return b""
