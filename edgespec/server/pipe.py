"""The one request pipe under both APIs: what gRPC (servicers.py) and HTTP (http_chat.py,
http_jobs.py) do alike between checking a request, submitting a job to the engine loop and
converting its answer to their protocol.

- `request_id`: a caller's request id checked (both APIs, and the gRPC interceptor's x-request-id).
- `next_events`: blocking, the next batch of a job's events (or a stream's, tagged with their
  choice's index) up to a result or an error, noticing an engine that went away.
- `job_events`: the same, one event at a time, until the job's result (raising its error).
- `raise_error`: a batch's error event raised.
- `check_end`: a result that ended by deadline, cancel or engine failure raised as its domain
  error (mapped to a status code by each protocol's one mapping: status.py, http_errors.STATUS).
- `check_capabilities`: what a request asks beyond plain generation (a constraint, a reasoning
  budget) refused, naming the field, when the engine does not apply it.
- `prompt_tokens`: a request's prompt tokenised in the handler's thread, never the engine's.

No protocol types here: each layer keeps only its conversion."""

from __future__ import annotations

import queue
import string
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from edgespec.errors import BadRequest, Cancelled, DeadlineExceeded, ModelError, NotReady
from edgespec.server.config import LimitsConfig
from edgespec.tools import ToolSpec, encode_request
from edgespec.types import ConstraintSpec, GenerationResult

POLL_SECONDS = 0.25  # how often a waiting request looks whether the engine is still there
REQUEST_ID_CHARS = frozenset(string.ascii_letters + string.digits + "-_.:")
REQUEST_ID_MAX = 128


class Events(Protocol):
    """A job's event queue as a reader sees it (queue.SimpleQueue)."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...

    def get_nowait(self) -> Any: ...


class Loaded(Protocol):
    """What the request checks read of the engine loop (EngineLoop, or a chat model's)."""

    @property
    def encoder(self) -> Any: ...  # the loaded target's thread-safe tokenizer and chat template, or None

    @property
    def ready(self) -> bool: ...

    @property
    def capabilities(self) -> frozenset[str]: ...  # "constraint": constraints and reasoning budgets apply


def request_id(rid: str, field: str = "request_id") -> str:
    """`rid` when it is at most 128 ASCII characters of [A-Za-z0-9-_.:] ("" too: none given);
    otherwise BadRequest naming `field` (str.isalnum() would also take 请, ٣ and friends)."""
    if len(rid) > REQUEST_ID_MAX or not REQUEST_ID_CHARS.issuperset(rid):
        raise BadRequest(field, f"at most {REQUEST_ID_MAX} characters of [A-Za-z0-9-_.:]")
    return rid


def next_events(events: Events, *, until_result: bool, stopped: Callable[[], bool],
                poll: float = POLL_SECONDS, wait: float | None = None) -> list[tuple[Any, ...]]:
    """Blocking: the events queued now (at least one), or all of them up to a result when
    `until_result`; a batch ends at a result or an error event (returned, not raised). Every
    `poll` seconds without an event, `stopped()` is asked: true (the engine thread is gone) raises
    NotReady. `events`: a job's own queue, or a stream's (its choices' events, tagged with their
    index: (kind, value, i)). `wait`: [] when no event came within that many seconds (a stream's
    keep-alive is due)."""
    out: list[tuple[Any, ...]] = []
    until = None if wait is None else time.monotonic() + wait
    while True:
        try:
            timeout = poll if until is None else max(0.0, min(poll, until - time.monotonic()))
            event = events.get(timeout=timeout) if until_result or not out else events.get_nowait()
        except queue.Empty:
            if out and not until_result:
                return out
            if stopped():
                raise NotReady("the engine stopped") from None
            if not out and until is not None and time.monotonic() >= until:
                return out
            continue
        out.append(event)
        if event[0] in ("result", "error"):
            return out


def raise_error(batch: Sequence[tuple[Any, ...]]) -> Sequence[tuple[Any, ...]]:
    """The batch, once none of its events is an error; else the first error's exception raised."""
    for event in batch:
        if event[0] == "error":
            raise event[1]
    return batch


def job_events(events: Events, *, stopped: Callable[[], bool], poll: float = POLL_SECONDS) -> Iterator[tuple[str, Any]]:
    """Blocking: each ("chunk", Chunk) as it comes, then ("result", GenerationResult) and the end;
    an ("error", exc) event raises exc where it stands (the chunks before it are yielded)."""
    while True:
        for kind, value in next_events(events, until_result=False, stopped=stopped, poll=poll):
            if kind == "error":
                raise value
            yield kind, value
            if kind == "result":
                return


def check_end(result: GenerationResult, *, deadline: str = "deadline exceeded", failed: bool = True) -> None:
    """Raise the domain error of a result that did not end on its own: "deadline" (DeadlineExceeded:
    f"{deadline} after N generated tokens", `deadline` saying which deadline in the protocol's
    words), "cancelled" (Cancelled) and, when `failed`, "error" (ModelError; a protocol that
    carries the reason in its answer, gRPC's FinishReason ERROR, passes failed=False)."""
    reason = result.finish_reason
    if reason == "deadline":
        raise DeadlineExceeded(f"{deadline} after {len(result.token_ids)} generated tokens")
    if reason == "cancelled":
        raise Cancelled("the request was cancelled")
    if reason == "error" and failed:
        raise ModelError("the engine failed on this request")


def check_capabilities(loop: Loaded, limits: LimitsConfig, *, constraint: ConstraintSpec | None, field: str,
                       value_field: str = "", budget: int | None = None, budget_field: str = "") -> None:
    """Refuse, naming the field in the protocol's words, what the engine does not apply: a
    constraint (`field`: where the request asked for one; its text at most
    limits.max_constraint_bytes, `value_field` naming the text when it is not `field`) and a
    reasoning budget (`budget_field`; the engine holds a budget as a constraint)."""
    if constraint is not None:
        if "constraint" not in loop.capabilities:
            raise BadRequest(field, "structured output is not available on this server's engine yet")
        n = len(constraint.value.encode("utf-8"))
        cap = getattr(limits, "max_constraint_bytes", n)
        if n > cap:
            raise BadRequest(value_field or field, f"at most {cap} bytes (limits.max_constraint_bytes), got {n}")
    if budget is not None and "constraint" not in loop.capabilities:
        raise BadRequest(budget_field, "a reasoning budget is not available on this server's engine")


def encoder(loop: Loaded) -> Any:
    """The loaded target's thread-safe tokenizer and chat template (EngineLoop.encoder); NotReady
    while the models load (it is set as the engine is built)."""
    enc = loop.encoder
    if enc is None:
        raise NotReady("the models are still loading")
    return enc


def prompt_tokens(loop: Loaded, chat_template: str, prompt: str, messages: Sequence[tuple[str, str]],
                  extras: Sequence[Mapping[str, Any]] = (), spec: ToolSpec | None = None, *,
                  variables: Mapping[str, Any] | None = None,
                  jinja: bool = False, rendered: list[str] | None = None) -> tuple[int, ...]:
    """The prompt's token ids, tokenised in the calling thread (a handler's: the engine thread gets
    token ids) with the loaded target's encoder and `chat_template` ([target] chat_template, "" =
    the GGUF's own); `rendered` gets the Jinja template's text (tools.encode_request). NotReady
    while the models load."""
    return tuple(encode_request(encoder(loop), prompt, messages, extras, spec, chat_template, variables=variables,
                                jinja=jinja, rendered=rendered))


__all__: Sequence[str] = ("POLL_SECONDS", "REQUEST_ID_CHARS", "check_capabilities", "check_end", "encoder", "job_events",
                          "next_events", "prompt_tokens", "raise_error", "request_id")
