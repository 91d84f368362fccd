"""OpenAI's Responses API (`POST /v1/responses`), stateless, over the one chat pipeline: a
Responses body is translated into the OpenAI chat body openai_api validates, and the answer (its
result, or its stream's events: edgespec.server.answer) is translated back into a `response`
object and Responses' streaming events. Pure: no I/O, no server, no engine.

What maps to what:

    instructions                            the first message, role system
    input (a string)                        one user message
    input items: message {role, content}    a message (input_text / output_text parts joined)
                 function_call              an assistant turn's tool_calls (call_id -> id)
                 function_call_output       a tool message (call_id -> tool_call_id)
                 reasoning                  the next assistant turn's reasoning_content (its
                                            reasoning_text, else its summary), shown as the chat
                                            template shows earlier reasoning (Qwen3, GLM: after the
                                            last user turn) or dropped
    tools [{type: function, name, description, parameters, strict}]   function tools
    tool_choice, parallel_tool_calls        as for chat completions ({type: function, name})
    text.format                             response_format (text, json_object, json_schema)
    max_output_tokens, temperature, top_p, stream, edgespec: as named
    reasoning.effort                        reasoning_effort (the chat template's variable; none:
                                            enable_thinking false; minimal, low: a 256- or 1024-token
                                            budget on the <think> block); a thinking model's
                                            reasoning is a reasoning output item

Nothing is stored: `previous_response_id` and `conversation` are refused with a 400 naming them
(send the whole conversation as input items), `background` too; `store`, `metadata`, `reasoning.summary`,
`include`, `truncation` and the other bookkeeping fields are accepted and ignored.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from edgespec.errors import BadRequest
from edgespec.server import answer
from edgespec.server.fields import FieldNames
from edgespec.tools import ToolCall
from edgespec.types import GenerationResult

_IGNORED = ("store", "metadata", "reasoning", "include", "truncation", "user", "safety_identifier", "service_tier",
            "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "max_tool_calls", "top_logprobs",
            "stream_options", "context_management", "access_programs", "moderation", "image")
_STATEFUL = {"previous_response_id": "this server keeps no responses (stateless): send the whole conversation "
                                     "as input items",
             "conversation": "this server keeps no conversations (stateless): send the whole conversation "
                             "as input items",
             "prompt": "stored prompt templates are not supported: send instructions and input",
             "background": "background responses are not supported (stateless)"}
_KNOWN = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
          "max_output_tokens", "temperature", "top_p", "stream", "edgespec", *_IGNORED, *_STATEFUL}


def to_chat(body: Any, *, strict: bool) -> tuple[dict, tuple[str, ...], list[int]]:
    """(the OpenAI chat body, the unknown fields ignored, per chat message the index of the input
    item it came from (-1: instructions)). BadRequest names the Responses field."""
    if not isinstance(body, Mapping):
        raise BadRequest("body", "must be a JSON object")
    unknown = tuple(str(k) for k in body if k not in _KNOWN)
    if unknown and strict:
        raise BadRequest(unknown[0], "unknown field ([http] strict = true)")
    for k, why in _STATEFUL.items():
        if body.get(k) not in (None, False):
            raise BadRequest(k, why)
    messages, origin = _input(body.get("instructions"), body.get("input"))
    chat: dict[str, Any] = {"messages": messages}
    for k in ("model", "temperature", "top_p", "stream", "edgespec", "parallel_tool_calls"):
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if (fmt := _format(body.get("text"))) is not None:
        chat["response_format"] = fmt
    effort = body.get("reasoning")
    if effort is not None:
        if not isinstance(effort, Mapping):
            raise BadRequest("reasoning", "must be an object {effort, summary}")
        if effort.get("effort") is not None:
            chat["reasoning_effort"] = effort["effort"]
    return chat, unknown, origin


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise BadRequest(where, f"must be a string, got {type(v).__name__}")
    return v


def _parts(v: Any, where: str) -> str:
    """A message's content: a string, or input_text / output_text parts (joined)."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise BadRequest(where, "must be a string or a list of text parts")
    out = []
    for j, p in enumerate(v):
        kind = p.get("type") if isinstance(p, Mapping) else None
        if kind not in ("input_text", "output_text", "text"):
            shown = kind if kind is not None else type(p).__name__
            raise BadRequest(f"{where}[{j}].type", f"only input_text and output_text parts are supported, got {shown!r}")
        out.append(_str(p.get("text"), f"{where}[{j}].text"))
    return "".join(out)


def _input(instructions: Any, v: Any) -> tuple[list[dict], list[int]]:
    out: list[dict] = []
    origin: list[int] = []
    if instructions is not None and _str(instructions, "instructions"):
        out.append({"role": "system", "content": instructions})
        origin.append(-1)
    if isinstance(v, str):
        if not v:
            raise BadRequest("input", "must not be empty")
        return [*out, {"role": "user", "content": v}], [*origin, 0]
    if not isinstance(v, list) or not v:
        raise BadRequest("input", "must be a string or a non-empty list of input items")
    thought = ""  # a reasoning item's text: the next assistant turn's reasoning_content
    for i, item in enumerate(v):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise BadRequest(where, "must be an input item object")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"{where}.role", f"must be user, assistant, system or developer, got {role!r}")
            out.append({"role": role, "content": _parts(item.get("content"), f"{where}.content")})
            if role == "assistant" and thought:
                out[-1]["reasoning_content"], thought = thought, ""
        elif kind == "function_call":
            call = {"id": _str(item.get("call_id"), f"{where}.call_id"), "type": "function",
                    "function": {"name": _str(item.get("name"), f"{where}.name"),
                                 "arguments": _str(item.get("arguments", "{}"), f"{where}.arguments")}}
            if out and out[-1]["role"] == "assistant" and origin[-1] >= 0 and not thought:
                out[-1].setdefault("tool_calls", []).append(call)  # the calls of one turn
                continue
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if thought:
                out[-1]["reasoning_content"], thought = thought, ""
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _str(item.get("call_id"), f"{where}.call_id"),
                        "content": _parts(output, f"{where}.output") if output is not None else ""})
        elif kind == "reasoning":
            thought = _reasoning_text(item, where)
            continue
        else:
            raise BadRequest(f"{where}.type", "must be message, function_call, function_call_output or reasoning, "
                                              f"got {kind!r}")
        origin.append(i)
    if not out or all(m["role"] == "system" for m in out):
        raise BadRequest("input", "holds no message")
    return out, origin


def _reasoning_text(item: Mapping, where: str) -> str:
    """A reasoning item's text: its reasoning_text content (as this server sends it), else its
    summary's text (encrypted_content, which only OpenAI can read, is ignored)."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise BadRequest(f"{where}.{key}", f"must be a list of {kind} parts")
        texts = [_str(p.get("text"), f"{where}.{key}[{j}].text") for j, p in enumerate(parts)
                 if isinstance(p, Mapping) and p.get("type") == kind]
        if texts:
            return "\n\n".join(texts)
    return ""


def _tools(v: Any) -> Any:
    if not isinstance(v, list):
        raise BadRequest("tools", "must be a list of {type: function, name, parameters}")
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, Mapping) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, Mapping) else None
            raise BadRequest(f"tools[{i}].type", f"only function tools are supported, got {kind!r}")
        f = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": f})
    return out


def _tool_choice(v: Any) -> Any:
    if isinstance(v, Mapping) and v.get("type") == "function":
        return {"type": "function", "function": {"name": v.get("name")}}
    return v


def _format(v: Any) -> dict | None:
    """text.format as response_format."""
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise BadRequest("text", "must be an object {format}")
    fmt = v.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise BadRequest("text.format", "must be an object with a type")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return {"type": fmt.get("type")}


_RENAMES = (
    (re.compile(r"^response_format\.json_schema"), "text.format"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
    (re.compile(r"^max_tokens"), "max_output_tokens"),
    (re.compile(r"^reasoning_effort"), "reasoning.effort"),
)


# the chat body's fields as the Responses body names them
NAMES = FieldNames(_RENAMES, "instructions", "input[{}]")
renamed = NAMES.renamed


# ---- the answer --------------------------------------------------------------------------------


def base_body(body: Mapping, *, rid: str, created: int, model: str) -> dict:
    """The response object's fields that echo the request (its output, status and usage come later)."""
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": None,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice", "auto"), "tools": list(body.get("tools") or []),
            "text": {"format": fmt}, "store": False, "metadata": body.get("metadata") or {}, "reasoning": None,
            "truncation": "disabled", "usage": None}


def usage(results: Sequence[GenerationResult], prompt_tokens: int) -> dict:
    r = results[0]
    p = r.prompt_tokens or prompt_tokens
    n = sum(len(x.token_ids) for x in results)
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": r.stats.cached_prompt_tokens},
            "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + n}


def _id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or _id("msg_"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: ToolCall, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or _id("fc_"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def response_body(base: Mapping, *, output: list[dict], finish: str, usage: dict,
                  stats: Mapping[str, Any] | None = None) -> dict:
    """The whole response: `completed`, or `incomplete` when max_output_tokens cut the answer."""
    cut = finish == "length"
    out = {**base, "status": "incomplete" if cut else "completed", "output": output,
           "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "usage": usage}
    if stats is not None:
        out["edgespec"] = dict(stats)
    return out


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or _id("rs_"), "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(content: str | None, calls: Sequence[ToolCall], finish: str, reasoning: str | None = None) -> list[dict]:
    status = "incomplete" if finish == "length" else "completed"
    items = [reasoning_item(reasoning, status)] if reasoning else []
    items += [message_item(content or "", status)] if content or not calls else []
    return items + [call_item(c) for c in calls]


class ResponseStream:
    """Responses' streaming events for a streamed answer (edgespec.server.answer, one choice):
    response.created and response.in_progress; per output item response.output_item.added, then
    for a message response.content_part.added, response.output_text.delta ...,
    response.output_text.done, response.content_part.done, or for a function call
    response.function_call_arguments.delta ... and .done (its arguments' JSON text in pieces as
    the model writes them); response.output_item.done; at the end response.completed (or
    response.incomplete when max_output_tokens cut it) with the whole response. Every event
    carries its sequence_number; a keep-alive comment while the request waits; an error ends
    the stream with an `error` event."""

    def __init__(self, base: Mapping, *, prompt_tokens: int):
        self.base, self.prompt_tokens = dict(base), prompt_tokens
        self.seq = 0
        self.output: list[dict] = []  # the items so far, the open one last
        self.open: dict | None = None
        self.ended: answer.End | None = None

    def _ev(self, kind: str, data: Mapping[str, Any]) -> bytes:
        payload = {"type": kind, **data, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def start(self) -> bytes:
        return self._ev("response.created", {"response": self.base}) + \
            self._ev("response.in_progress", {"response": self.base})

    def _begin(self, item: dict) -> bytes:
        out = self._close()
        self.open = item
        self.output.append(item)
        index = len(self.output) - 1
        shown = {**item, "content": []} if item["type"] == "message" else item  # its part is added next
        out += self._ev("response.output_item.added", {"output_index": index, "item": shown})
        if item["type"] == "message":
            out += self._ev("response.content_part.added", {"item_id": item["id"], "output_index": index,
                                                            "content_index": 0, "part": item["content"][0]})
        return out

    def _close(self, status: str = "completed") -> bytes:
        item = self.open
        if item is None:
            return b""
        self.open = None
        item["status"] = status
        index = len(self.output) - 1
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "reasoning":
            out = self._ev("response.reasoning_text.done", {**at, "content_index": 0,
                                                            "text": item["content"][0]["text"]})
        elif item["type"] == "message":
            part = item["content"][0]
            out = self._ev("response.output_text.done", {**at, "content_index": 0, "text": part["text"],
                                                         "logprobs": []})
            out += self._ev("response.content_part.done", {**at, "content_index": 0, "part": part})
        else:
            out = self._ev("response.function_call_arguments.done", {**at, "name": item["name"],
                                                                     "arguments": item["arguments"]})
        return out + self._ev("response.output_item.done", {"output_index": index, "item": item})

    def _text_delta(self, kind: str, make: Callable[[str, str], dict], name: str, text: str,
                    **extra: Any) -> bytes:
        """`text` appended to the open item of `kind` (a reasoning or a message item), opened first
        when the open item is another, as event `name`."""
        item, out = self.open, b""
        if item is None or item["type"] != kind:
            item = make("", "in_progress")
            out = self._begin(item)
        item["content"][0]["text"] += text
        return out + self._ev(name, {"item_id": item["id"], "output_index": len(self.output) - 1,
                                     "content_index": 0, "delta": text, **extra})

    def event(self, ev: answer.Event) -> bytes:
        if isinstance(ev, answer.Reasoning):
            return self._text_delta("reasoning", reasoning_item, "response.reasoning_text.delta", ev.text)
        if isinstance(ev, answer.Text):
            return self._text_delta("message", message_item, "response.output_text.delta", ev.text, logprobs=[])
        if isinstance(ev, answer.Call):
            d = ev.delta
            if d.id is not None:
                return self._begin(call_item(ToolCall(d.id, d.name or "", ""), "in_progress"))
            assert self.open is not None
            self.open["arguments"] += d.arguments
            return self._ev("response.function_call_arguments.delta", {
                "item_id": self.open["id"], "output_index": len(self.output) - 1, "delta": d.arguments})
        if isinstance(ev, answer.End):
            self.ended = ev
            return self._close("incomplete" if ev.finish == "length" else "completed")
        if isinstance(ev, answer.Usage):
            finish = self.ended.finish if self.ended is not None else "eos"
            if not self.output:  # an empty answer is an empty message, as unary
                self.output.append(message_item("", "incomplete" if finish == "length" else "completed"))
            body = response_body(self.base, output=self.output, finish=finish,
                                 usage=usage(ev.results, self.prompt_tokens))
            kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            return self._ev(kind, {"response": body})
        return b": ping\n\n"  # Waiting

    def error(self, status: int, message: str, openai_body: Mapping) -> bytes:
        err = openai_body["error"]
        return self._ev("error", {"code": err.get("code") or err.get("type"), "message": message,
                                  "param": err.get("param")})

    def end(self) -> bytes:
        return b""
