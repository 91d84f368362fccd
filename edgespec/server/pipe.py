"""The one request pipe under both APIs: what gRPC (servicers.py) and HTTP (http_api.py) do alike
between submitting a job to the engine loop and converting its answer to their protocol.

- `request_id`: a caller's request id checked (both APIs, and the gRPC interceptor's x-request-id).
- `next_events`: blocking, the next batch of a job's events (or a stream's, tagged with their
  choice's index) up to a result or an error, noticing an engine that went away.
- `job_events`: the same, one event at a time, until the job's result (raising its error).
- `raise_error`: a batch's error event raised.
- `check_end`: a result that ended by deadline, cancel or engine failure raised as its domain
  error (mapped to a status code by each protocol's one mapping: status.py, http_errors.STATUS).

No protocol types here: each layer keeps only its conversion."""

from __future__ import annotations

import queue
import string
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from edgespec.errors import BadRequest, Cancelled, DeadlineExceeded, ModelError, NotReady
from edgespec.types import GenerationResult

POLL_SECONDS = 0.25  # how often a waiting request looks whether the engine is still there
REQUEST_ID_CHARS = frozenset(string.ascii_letters + string.digits + "-_.:")
REQUEST_ID_MAX = 128


class Events(Protocol):
    """A job's event queue as a reader sees it (queue.SimpleQueue)."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...

    def get_nowait(self) -> Any: ...


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


__all__: Sequence[str] = ("POLL_SECONDS", "REQUEST_ID_CHARS", "check_end", "job_events", "next_events",
                          "raise_error", "request_id")
