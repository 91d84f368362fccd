"""The ONE engine thread. It owns the llama.cpp contexts (all engine calls happen here), admits
jobs from a bounded queue into up to `parallel` sessions, and runs engine ticks: each tick
advances every active session by one step in one batched target forward (edgespec/tick/), and
prefills new prompts in pieces alongside. Chunks go to a per-job unbounded queue: the engine
never waits for a reader (output is bounded by max_tokens). Cancel and deadline are checked
between ticks, so a cancelled request stops within one tick and frees its slot, a prefill too; and
a watch thread stops a tick within one graph node (`abort_forward`: the patched llama.cpp's abort
flag) once every request in it is cancelled or past its deadline (a lone long prompt read in
whole n_batch pieces), so the next request starts at once."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from edgespec.errors import NotReady
from edgespec.logs import get_logger
from edgespec.server.loop_abort import AbortWatch
from edgespec.server.loop_audit import ShadowAudit
from edgespec.server.loop_contract import CallerPlace, Job, LoopEngine, LoopSession
from edgespec.server.loop_intake import Intake
from edgespec.server.loop_running import Figures, Running
from edgespec.server.metrics import Metrics

__all__ = ["CallerPlace", "EngineLoop", "Job", "LoopEngine", "LoopSession"]

log = get_logger("edgespec.server.engine")


class EngineLoop:
    """`factory()` builds the engine *on the engine thread* (then `warmup()`); jobs go in with
    `submit`, one-off engine calls (tokenize, model_info) with `call`. Its rooms: the intake
    (loop_intake: the queue, admission, drain), the running requests (loop_running), the abort
    watch and idle work (loop_abort), and the [audit] shadows (loop_audit)."""

    def __init__(
        self,
        factory: Callable[[], LoopEngine],
        *,
        parallel: int,
        queue_size: int,
        metrics: Metrics | None = None,
        on_ready: Callable[[], None] | None = None,
        on_heartbeat: Callable[[], None] | None = None,
        log_text: bool = False,
        shadow_fraction: float = 0.0,
        shadow_queue: int = 16,
        seed: int | None = None,
    ):
        self._factory = factory
        self.parallel = parallel
        self.queue_size = queue_size
        self.metrics = metrics if metrics is not None else Metrics()  # the loop's counters
        self._on_ready = on_ready
        self._on_heartbeat = on_heartbeat
        self._log_text = log_text
        self._ready = threading.Event()
        self._started = threading.Event()  # set when loading finished, ok or not
        self._error: BaseException | None = None
        self._intake = Intake(parallel, queue_size, self.metrics, self._ready)
        # [audit]: finished greedy speculative requests waiting for their plain shadow decode
        self._audit = ShadowAudit(shadow_fraction, shadow_queue, seed, self.metrics, self._intake.lock)
        self.figures = Figures()  # the engine's, after each tick
        # what the loaded engine applies beyond plain generation ("constraint"): its `capabilities`
        # attribute; the APIs refuse a request needing one it lacks
        self.capabilities: frozenset[str] = frozenset()
        self.encoder: Any = None  # the engine's, once it is built (see _load): None while loading
        # the engine's thread-safe constraint compiler (LoopEngine.compile_constraint), once built
        self._compile: Callable[[Any], Any] | None = None
        self._thread = threading.Thread(target=self._run, name="edgespec-engine", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """True when the engine is loaded and warmed; raises the load error if loading failed."""
        self._started.wait(timeout)
        if self._error is not None:
            raise self._error
        return self._ready.is_set()

    @property
    def loaded(self) -> bool:
        """The engine is built and warmed (draining or not)."""
        return self._ready.is_set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._intake.draining and not self._intake.stopping

    @property
    def error(self) -> BaseException | None:
        """Why the engine thread failed to load or crashed (None when fine)."""
        return self._error

    @property
    def stopped(self) -> bool:
        """The engine thread is gone (stopped, crashed, or failed to load)."""
        return self._started.is_set() and not self._thread.is_alive()

    @property
    def draining(self) -> bool:
        return self._intake.draining or self._intake.stopping

    def drain(self, on: bool = True) -> None:
        """Stop admitting new jobs (queued and active ones still finish)."""
        self._intake.flag(draining=on)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Cancel everything left, close the engine and join the thread."""
        self._intake.flag(stopping=True)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- producer side (gRPC handler threads) ----------------------------------------------

    def submit(self, job: Job) -> Job:
        self._intake.submit(job)
        return job

    def call(self, fn: Callable[[Any], Any], timeout: float | None = 60.0) -> Any:
        """Run `fn(engine)` on the engine thread and return its result (or raise its exception)."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        self._intake.call((fn, out))
        try:
            ok, value = out.get(timeout=timeout)
        except queue.Empty:
            raise NotReady("the engine did not answer in time") from None
        if not ok:
            raise value
        return value

    @property
    def tick_totals(self) -> dict[str, float]:
        return self.figures.tick_totals

    @property
    def suffix_cache(self) -> dict[str, Any]:
        return self.figures.suffix_cache

    @property
    def breaker_state(self) -> str:
        return self.figures.breaker_state

    @property
    def aborted_ticks(self) -> int:
        return self.figures.aborted_ticks

    @property
    def shadow_fraction(self) -> float:
        return self._audit.fraction

    def stats(self) -> dict[str, Any]:
        intake, f = self._intake, self.figures
        with intake.lock:
            return {
                "active_requests": intake.active_n,
                "queue_depth": len(intake.pending),
                "queue_capacity": self.queue_size,
                "parallel": self.parallel,
                "ready": self._ready.is_set(),
                "draining": self.draining,
                "breaker_state": f.breaker_state,
                "tick_totals": f.tick_totals,
                "suffix_cache": f.suffix_cache,
                "proposed_by_source": {k: int(v) for k, v in self.metrics.proposed_by_source.values().items()},
                "accepted_by_source": {k: int(v) for k, v in self.metrics.accepted_by_source.values().items()},
                "idle": intake.idle_done and not intake.pending and not intake.active_n,
                **self.metrics.totals(),
            }

    def compile(self, constraint: Any) -> Any:
        """A request's constraint compiled in the calling handler thread (a grammar state for
        Job.matcher: one per job, it is stateful), or None when there is none or the engine is
        not loaded yet; BadRequest naming the field when it does not compile. A large schema or
        grammar then costs its own caller the time, never the engine thread."""
        if constraint is None or self._compile is None:
            return None
        return self._compile(constraint)

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        running = self._load()
        if running is None:
            return
        try:
            self._serve(running)
        except BaseException as exc:  # the loop itself must not die silently
            log.error("engine_loop_crashed", error=str(exc), exc_info=True)
            self._error = exc
        finally:
            self._shutdown(running)
            running.watch.wake()

    def _load(self) -> Running | None:
        """The engine built and warmed, its abort watch started; None if that failed (the
        error reported to the starter)."""
        try:
            engine = self._factory()
            # the engine's thread-safe tokenizer, chat template and constraint compiler, for the
            # handler threads: they tokenise and compile, the engine thread only decodes
            self.encoder = engine.encoder
            self._compile = engine.compile_constraint
            engine.warmup()
            self.capabilities = frozenset(engine.capabilities)
        except BaseException as exc:  # reported to the starter
            self._error = exc
            log.error("engine_load_failed", error=str(exc), exc_info=True)
            self._started.set()
            return None
        watch = AbortWatch(engine.abort_forward, stopping=lambda: self._intake.stopping)
        watch.start()
        self._ready.set()
        self._started.set()
        log.info("engine_ready", parallel=self.parallel, queue_size=self.queue_size)
        if self._on_ready:
            self._on_ready()
        return Running(engine, metrics=self.metrics, audit=self._audit, watch=watch, figures=self.figures,
                       log_text=self._log_text)

    def _serve(self, running: Running) -> None:
        """Turn after turn until stopped: calls run, jobs opened, one tick over the active ones;
        with nothing to run, one short piece of idle work, or a wait for an arrival."""
        engine, intake = running.engine, self._intake
        idle_left = False  # the engine has idle work to do (LoopEngine.idle_work)
        while (turn := intake.take(len(running.active), idle_left, self._audit.next)) is not None:
            if not turn.idle:
                idle_left = True  # requests ran: they may leave a context to absorb
            elif not turn.waited:
                # one short piece (a draft forward of a few tokens), then look for work again: a
                # request arriving meanwhile stops the piece (IdleWork.arrived)
                idle_left = intake.idle.piece(engine, turn.looked)
            for fn, out in turn.calls:
                try:
                    out.put((True, fn(engine)))
                except BaseException as exc:  # handed to the caller
                    out.put((False, exc))
            for job in turn.to_open:
                running.open(job)
            running.expire()
            if running.active:
                running.tick()
            intake.ran(len(running.active))
            if self._on_heartbeat:  # progress made (one tick), or an idle wait came round
                self._on_heartbeat()

    def _shutdown(self, running: Running) -> None:
        running.cancel_all()
        pending, calls = self._intake.close()
        for job in pending:
            job.finish()
            job.answer("error", NotReady("the server is shutting down"))
        for _fn, out in calls:
            out.put((False, NotReady("the server is shutting down")))
        try:
            running.engine.close()
        except BaseException as exc:
            log.warning("engine_close_failed", error=str(exc))
        log.info("engine_stopped")
