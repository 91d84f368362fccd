"""What the engine loop (engine_loop.EngineLoop) trades with the rest of the daemon: the engine
it drives (`LoopEngine`) and that engine's sessions (`LoopSession`), a caller's place under its
limits (`CallerPlace`), and the `Job` a handler thread submits and reads its answer from."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from edgespec.sampling import SamplingParams
from edgespec.types import Chunk, FinishReason, GenerationRequest, GenerationResult, SpeculationParams

if TYPE_CHECKING:
    from edgespec.drafters.suffix import SuffixCache


class LoopSession(Protocol):
    """What the loop needs of one request's session (edgespec.session.Session)."""

    @property
    def breaker_state(self) -> str | None: ...  # an auto request's breaker state, None otherwise

    @property
    def done(self) -> bool: ...

    def result(self) -> GenerationResult: ...

    def close(self, reason: FinishReason | None = None) -> None: ...


class CallerPlace(Protocol):
    """A request's place under its caller's limits (edgespec.server.callers.Place)."""

    state: str  # "queued", "running" or "released"

    def start(self) -> bool: ...  # queued -> running if the caller is under its concurrent limit

    def release(self) -> None: ...  # the job left its slot or the queue

    def used(self, tokens: int) -> None: ...  # tokens the job cost, charged to its caller's window


S = TypeVar("S", bound=LoopSession)


@runtime_checkable
class LoopEngine(Protocol[S]):
    """What the loop and the daemon need of an engine (edgespec.engine.Engine; the tests'
    FakeEngine), every member required. All of it runs on the loop's thread, except `encoder`
    and `compile_constraint`, which the handler threads use, and `abort_forward` and
    `abort_idle_work`, which the loop's other threads call."""

    capabilities: frozenset[str]  # "constraint", "logprobs": what requests may ask of it
    suffix_cache: SuffixCache  # the cross-request suffix cache (its snapshot: daemon.py)

    @property
    def tick_totals(self) -> Mapping[str, float]: ...  # seconds per tick phase, ticks, ... since load

    @property
    def encoder(self) -> Any: ...  # the thread-safe tokenizer and chat template (backend.Model)

    def compile_constraint(self, spec: Any) -> Any: ...  # a request's grammar state, from any thread

    def warmup(self) -> None: ...

    def open_session(self, req: GenerationRequest) -> S: ...  # S: its own session type

    def tick(self, sessions: Sequence[S]) -> Mapping[S, Chunk]: ...

    def idle_work(self) -> bool: ...  # one piece of background work; True while more is left

    def close(self) -> None: ...

    # stop the forward in progress at its next graph node, from any thread (the tick then raises
    # errors.ForwardAborted); the flag holds until the next tick starts
    def abort_forward(self) -> None: ...

    # stop idle work's forward at its next graph node, from any thread (True), and lower that
    # flag again on the engine thread (False)
    def abort_idle_work(self, on: bool = True) -> None: ...

    def suffix_stats(self) -> dict[str, Any]: ...  # the suffix cache's figures

    # the suffix cache on or off (off empties it) and/or emptied (SetPolicy, a reload); its figures
    def suffix_control(self, enabled: bool | None = None, clear: bool = False) -> dict[str, Any]: ...


@dataclass
class Job:
    """One generation request on its way through the engine thread."""

    request_id: str
    sampling: SamplingParams
    speculation: SpeculationParams
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    # the prompt tokenised by the caller's thread with the engine's encoder (chat template
    # applied): the engine thread does no text work. A job without them is refused at open.
    prompt_tokens: tuple[int, ...] | None = None
    logprobs: int | None = None  # see GenerationRequest.logprobs
    constraint: Any = None  # a types.ConstraintSpec, or None
    matcher: Any = None  # `constraint` compiled in the handler's thread (EngineLoop.compile), or None
    constraint_field: str = "constraint"  # where the request asked for `constraint` (what its errors name)
    caller: str = ""  # the caller's identity (auth.Decision.identity): its suffix cache partition
    tools: Any = None  # an edgespec.tools.ToolSpec (its grammar is `constraint`): the answer is parsed for calls
    deadline: float | None = None  # time.monotonic() value
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None  # admitted to a slot
    first_token: float | None = None
    finished: float | None = None
    # ("chunk", Chunk) ... then exactly one ("result", GenerationResult) or ("error", Exception)
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _cancel: threading.Event = field(default_factory=threading.Event)
    # an [audit] shadow decode: (the audited request's id, its output token ids); None otherwise
    shadow_of: tuple[str, tuple[int, ...]] | None = None
    # its place under the caller's limits ([limits] caller_*): started as the job gets a slot,
    # released as it finishes; None: no per-caller limits
    place: CallerPlace | None = None
    emitted: int = 0  # tokens it has emitted so far
    charge_prompt: bool = True  # False: another job of the same request pays for the prompt (n > 1)
    # at submit, every slot was taken: the job waits in the queue behind other requests
    queued: bool = False
    # set once the engine opened the job (its session, or the error that refused it), or it ended
    opened: threading.Event = field(default_factory=threading.Event)

    def finish(self, charged: bool = False) -> None:
        """The job is done in the engine (a result, an error, or it left the queue). `charged`:
        it ran, and what it cost (its prompt and the tokens it emitted) goes into its caller's
        tokens-per-minute window here, whether or not its client is still there to read the end."""
        self.finished = time.monotonic()
        if self.place is not None:
            if charged:
                self.place.used(len(self.prompt_tokens or ()) * self.charge_prompt + self.emitted)
            self.place.release()

    def answer(self, kind: str, value: Any) -> None:
        """The job's last event ("result" or "error"), then `opened`: a reader of `opened` finds it."""
        self.events.put((kind, value))
        self.opened.set()

    def cancel(self) -> None:
        """Thread-safe; the engine notices within one step."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def stop_reason(self, now: float) -> FinishReason:
        """Why a cancelled or expired job stops: a passed deadline also cancels the RPC, so it is
        reported as the deadline."""
        return "deadline" if self.expired(now) else "cancelled"

    def timings(self) -> dict[str, float]:
        end = self.finished or time.monotonic()
        start = self.started or end
        return {
            "queue_seconds": start - self.submitted,
            "time_to_first_token_seconds": (self.first_token - self.submitted) if self.first_token else 0.0,
            "total_seconds": end - self.submitted,
        }
