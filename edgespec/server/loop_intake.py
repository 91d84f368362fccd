"""The engine loop's intake: the bounded queue between the handler threads and the engine thread.
Jobs wait in it for a slot, one-off engine calls for the engine thread's next turn; free slots go
to queued jobs in order, each once its caller is under its concurrent limit. One lock guards it,
the drain and stop flags, and the count of arrivals that interrupts idle work."""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgespec.errors import NotReady, Overloaded
from edgespec.server.loop_abort import IdleWork
from edgespec.server.loop_contract import Job
from edgespec.server.metrics import Metrics
from edgespec.types import FinishReason, GenerationResult, SpecStats

HEARTBEAT_SECONDS = 1.0
BLOCKED_SECONDS = 0.01  # idle with queued jobs whose callers are at their concurrent limit

Call = tuple[Callable[[Any], Any], queue.SimpleQueue]  # fn(engine), and where its (ok, value) goes


def finish_unstarted(job: Job, reason: FinishReason, metrics: Metrics) -> None:
    """A job that never ran ends empty, as `reason` ("cancelled", "deadline")."""
    job.finish()
    metrics.requests.inc(label=reason)
    job.answer("result", GenerationResult(text="", token_ids=[], finish_reason=reason, prompt_tokens=0,
                                          stats=SpecStats()))


@dataclass
class Turn:
    """What one turn of the engine thread takes from the intake."""

    to_open: list[Job] = field(default_factory=list)  # admitted: they hold their slots already
    calls: list[Call] = field(default_factory=list)
    idle: bool = False  # nothing to run: no active session, no job to open, no call
    waited: bool = False  # ... and no idle work was left: the turn waited for an arrival
    looked: int = 0  # the arrivals seen (IdleWork.piece)


class Intake:
    """Jobs and calls in from the handler threads (`submit`, `call`), out to the engine thread
    (`take`). Admits at most `parallel` jobs to slots, and `queue_size` more to wait; `loaded`
    is set once the engine is ready for them."""

    def __init__(self, parallel: int, queue_size: int, metrics: Metrics, loaded: threading.Event):
        self.parallel = parallel
        self.queue_size = queue_size
        self.metrics = metrics
        self.loaded = loaded
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.pending: collections.deque[Job] = collections.deque()
        self.calls: collections.deque[Call] = collections.deque()
        self.active_n = 0  # jobs in slots, those being opened included
        self.draining = False
        self.stopping = False
        self.idle_done = False  # no job, no call and no idle work left (see take)
        self.idle = IdleWork(self.lock)

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.stopping or self.draining:
                raise NotReady("the server is draining; retry on another replica")
            if not self.loaded.is_set():
                raise NotReady("the models are still loading")
            if len(self.pending) + self.active_n >= self.parallel + self.queue_size:
                self.metrics.rejected.inc(label="overloaded")
                raise Overloaded(
                    f"server busy: {self.active_n} active and {len(self.pending)} queued "
                    f"(parallel={self.parallel}, queue_size={self.queue_size})"
                )
            job.queued = len(self.pending) + self.active_n >= self.parallel
            self.pending.append(job)
            self.idle_done = False
            self.metrics.submitted.inc()
            self.idle.arrived()
            self.wake.notify()

    def call(self, call: Call) -> None:
        with self.lock:
            if self.stopping:
                raise NotReady("the server is shutting down")
            if not self.loaded.is_set():
                raise NotReady("the models are still loading")
            self.calls.append(call)
            self.idle.arrived()
            self.wake.notify()

    def flag(self, *, draining: bool | None = None, stopping: bool | None = None) -> None:
        """Set the drain or stop flag, and wake the engine thread to see it."""
        with self.lock:
            if draining is not None:
                self.draining = draining
            if stopping is not None:
                self.stopping = stopping
            self.wake.notify_all()

    def take(self, n_active: int, idle_left: bool, spare: Callable[[], Job | None]) -> Turn | None:
        """The engine thread's next turn (None: stop): queued jobs admitted to the free slots, the
        calls waiting, and, when there is nothing else, `spare()` (an audit shadow decode). With
        nothing to do and no idle work left (`idle_left`), it waits for an arrival first."""
        turn = Turn()
        with self.lock:
            if self.stopping:
                return None
            self._expire_pending()
            self._admit(n_active, turn.to_open)
            if not n_active and not turn.to_open and not self.calls and (job := spare()) is not None:
                turn.to_open.append(job)  # idle: one audit shadow decode
            self.active_n = n_active + len(turn.to_open)  # jobs being opened hold their slot already
            turn.calls = list(self.calls)
            self.calls.clear()
            turn.idle = not n_active and not turn.to_open and not turn.calls
            turn.looked = self.idle.arrivals
            turn.waited = turn.idle and not idle_left
            self.idle_done = turn.waited and not self.pending
            if turn.waited:
                # queued jobs left while slots are free wait for their callers' places (an
                # embedding's, released off this thread): look again soon
                self.wake.wait(BLOCKED_SECONDS if self.pending else HEARTBEAT_SECONDS)
        return turn

    def ran(self, n_active: int) -> None:
        """The turn is over: `n_active` jobs hold slots now."""
        with self.lock:
            self.active_n = n_active

    def close(self) -> tuple[list[Job], list[Call]]:
        """Stop: the jobs still queued and the calls not run, taken out."""
        with self.lock:
            self.active_n = 0
            pending, self.pending = list(self.pending), collections.deque()
            calls, self.calls = list(self.calls), collections.deque()
            self.stopping = True
        return pending, calls

    def _expire_pending(self) -> None:
        """Queued jobs whose caller went away or whose deadline passed leave the queue now."""
        now = time.monotonic()
        keep: collections.deque[Job] = collections.deque()
        for job in self.pending:
            if job.cancelled or job.expired(now):
                finish_unstarted(job, job.stop_reason(now), self.metrics)
            else:
                keep.append(job)
        self.pending = keep

    def _admit(self, n_active: int, to_open: list[Job]) -> None:
        """Free slots go to the queued jobs in order, each once its caller is under its
        concurrent limit (`CallerPlace.start`): a job waiting for its own caller's slot does not
        hold back another caller's."""
        if not self.pending or n_active >= self.parallel:
            return
        keep: collections.deque[Job] = collections.deque()
        while self.pending:
            job = self.pending.popleft()
            if n_active + len(to_open) >= self.parallel:
                keep.append(job)
            elif job.place is None or job.place.start():
                to_open.append(job)
            elif job.place.state == "released":  # its handler gave up on it: it never runs
                job.cancel()
                finish_unstarted(job, "cancelled", self.metrics)
            else:
                keep.append(job)
        self.pending = keep
