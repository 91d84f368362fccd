"""Stopping an engine forward early, from another thread than the engine's (the patched
llama.cpp's abort flag): the watch over a running tick, which aborts its forward once no request
in it wants it any more, and idle work, whose piece in progress stops when a job or call arrives."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from edgespec.logs import get_logger
from edgespec.server.loop_contract import Job, LoopEngine

log = get_logger("edgespec.server.engine")

WATCH_SECONDS = 0.005  # how often the watch thread looks at a running tick's requests


class AbortWatch:
    """While a tick runs (`over`): abort its forward (`abort`) once every request in it is
    cancelled or past its deadline, so that a lone long prompt read in whole n_batch pieces stops
    within one graph node and the next request starts at once. The engine then raises
    ForwardAborted and the loop closes the tick's requests. Runs until `stopping()`."""

    def __init__(self, abort: Callable[[], None], stopping: Callable[[], bool]):
        self._abort = abort
        self._stopping = stopping
        self._lock = threading.Lock()
        self._jobs: list[Job] | None = None  # the jobs of the tick in progress, None between ticks
        self._wake = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name="edgespec-abort-watch", daemon=True).start()

    @contextlib.contextmanager
    def over(self, jobs: list[Job]) -> Iterator[None]:
        """Watch `jobs` for as long as the block (one tick) runs."""
        with self._lock:
            self._jobs = jobs
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._jobs = None

    def wake(self) -> None:
        """Let the watch see `stopping()` (the loop has stopped)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping():
            self._wake.wait()
            while not self._stopping():
                with self._lock:
                    jobs = self._jobs
                    if jobs is None:
                        self._wake.clear()
                        break
                    now = time.monotonic()
                    if jobs and all(j.cancelled or j.expired(now) for j in jobs):
                        self._abort()  # again each round: a tick clears it as it starts
                time.sleep(WATCH_SECONDS)


class IdleWork:
    """The engine's idle work (LoopEngine.idle_work), one short piece at a time: a job or call
    arriving meanwhile (`arrived`) stops the piece in progress (LoopEngine.abort_idle_work).
    `lock` is the intake's: arrivals are counted under it."""

    def __init__(self, lock: threading.Lock):
        self._lock = lock
        self.arrivals = 0  # jobs and calls submitted so far
        self._idling = False  # a piece is running
        self._stopped = False  # ... and an arrival stopped it
        self._abort: Callable[[bool], None] | None = None  # the running piece's engine.abort_idle_work

    def arrived(self) -> None:
        """A job or call arrived: stop the piece in progress (under the lock)."""
        self.arrivals += 1
        if self._idling and not self._stopped and self._abort is not None:
            self._stopped = True
            self._abort(True)

    def piece(self, engine: LoopEngine, looked: int) -> bool:
        """One piece of the engine's idle work, unless a job or call arrived since the loop
        looked (`looked`: the arrivals it had seen); whether more is left."""
        with self._lock:
            if self.arrivals != looked:
                return True  # something came since the loop looked: it goes round to it first
            self._idling, self._abort = True, engine.abort_idle_work
        try:
            return bool(engine.idle_work())
        except Exception:  # an optimisation: never let it take the loop down
            log.warning("idle_work_failed", exc_info=True)
            return False
        finally:
            with self._lock:
                stopped, self._idling, self._stopped = self._stopped, False, False
            if stopped:  # no one raises the flag again now
                engine.abort_idle_work(False)
