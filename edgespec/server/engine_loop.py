"""The ONE engine thread. It owns the llama.cpp contexts (all engine calls happen here), admits
jobs from a bounded queue, and steps up to `parallel` sessions round-robin so every stream
progresses. Chunks go to a per-job unbounded queue: the engine never waits for a reader (output
is bounded by max_tokens). Cancel and deadline are checked between steps, so a cancelled request
stops within one step and frees its slot."""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgespec.errors import NotReady, Overloaded
from edgespec.logs import get_logger
from edgespec.sampling import SamplingParams
from edgespec.types import Chunk, GenerationRequest, GenerationResult, SpecStats, SpeculationParams

log = get_logger("edgespec.server.engine")

HEARTBEAT_SECONDS = 1.0


@dataclass
class Job:
    """One generation request on its way through the engine thread."""

    request_id: str
    sampling: SamplingParams
    speculation: SpeculationParams
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    # the prompt already tokenised by the caller's thread (chat template applied): the engine
    # thread then does no text work for this job; None: the engine tokenises prompt/messages
    prompt_tokens: tuple[int, ...] | None = None
    logprobs: int | None = None  # see GenerationRequest.logprobs
    constraint: Any = None  # a types.ConstraintSpec, or None
    deadline: float | None = None  # time.monotonic() value
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None  # admitted to a slot
    first_token: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    # ("chunk", Chunk) ... then exactly one ("result", GenerationResult) or ("error", Exception)
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Thread-safe; the engine notices within one step."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def timings(self) -> dict[str, float]:
        end = self.finished or time.monotonic()
        start = self.started or end
        return {
            "queue_seconds": start - self.submitted,
            "time_to_first_token_seconds": (self.first_token - self.submitted) if self.first_token else 0.0,
            "total_seconds": end - self.submitted,
        }


@dataclass
class _Active:
    job: Job
    session: Any


class EngineLoop:
    """`factory()` builds the engine *on the engine thread* (then `warmup()`); jobs go in with
    `submit`, one-off engine calls (tokenize, model_info) with `call`."""

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        parallel: int,
        queue_size: int,
        metrics: Any = None,
        on_ready: Callable[[], None] | None = None,
        on_heartbeat: Callable[[], None] | None = None,
        log_text: bool = False,
    ):
        self._factory = factory
        self.parallel = parallel
        self.queue_size = queue_size
        self._metrics = metrics
        self._on_ready = on_ready
        self._on_heartbeat = on_heartbeat
        self._log_text = log_text
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: collections.deque[Job] = collections.deque()
        self._calls: collections.deque[tuple[Callable[[Any], Any], queue.SimpleQueue]] = collections.deque()
        self._active_n = 0
        self._ready = threading.Event()
        self._started = threading.Event()  # set when loading finished, ok or not
        self._draining = False
        self._stopping = False
        self._error: BaseException | None = None
        self.breaker_state = ""
        # what the loaded engine applies beyond plain generation ("constraint"): its `capabilities`
        # attribute; the APIs refuse a request needing one it lacks
        self.capabilities: frozenset[str] = frozenset()
        self.counters = collections.Counter()  # requests_total, rejected_overloaded_total, ...
        self._thread = threading.Thread(target=self._run, name="edgespec-engine", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """True when the engine is loaded and warmed; raises the load error if loading failed."""
        self._started.wait(timeout)
        if self._error is not None:
            raise self._error
        return self._ready.is_set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._draining and not self._stopping

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
        return self._draining or self._stopping

    def drain(self, on: bool = True) -> None:
        """Stop admitting new jobs (queued and active ones still finish)."""
        with self._lock:
            self._draining = on
            self._wake.notify_all()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Cancel everything left, close the engine and join the thread."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- producer side (gRPC handler threads) ----------------------------------------------

    def submit(self, job: Job) -> Job:
        with self._lock:
            if self._stopping or self._draining:
                raise NotReady("the server is draining; retry on another replica")
            if not self._ready.is_set():
                raise NotReady("the models are still loading")
            if len(self._pending) + self._active_n >= self.parallel + self.queue_size:
                self.counters["rejected_overloaded_total"] += 1
                if self._metrics is not None:
                    self._metrics.rejected.inc(label="overloaded")
                raise Overloaded(
                    f"server busy: {self._active_n} active and {len(self._pending)} queued "
                    f"(parallel={self.parallel}, queue_size={self.queue_size})"
                )
            self._pending.append(job)
            self.counters["requests_total"] += 1
            self._wake.notify()
        return job

    def call(self, fn: Callable[[Any], Any], timeout: float | None = 60.0) -> Any:
        """Run `fn(engine)` on the engine thread and return its result (or raise its exception)."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            if self._stopping:
                raise NotReady("the server is shutting down")
            if not self._ready.is_set():
                raise NotReady("the models are still loading")
            self._calls.append((fn, out))
            self._wake.notify()
        try:
            ok, value = out.get(timeout=timeout)
        except queue.Empty:
            raise NotReady("the engine did not answer in time") from None
        if not ok:
            raise value
        return value

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "active_requests": self._active_n,
                "queue_depth": len(self._pending),
                "queue_capacity": self.queue_size,
                "parallel": self.parallel,
                "ready": self._ready.is_set(),
                "draining": self.draining,
                "breaker_state": {self.breaker_state: 1} if self.breaker_state else {},
                **self.counters,
            }

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._factory()
            engine.warmup()
            self.capabilities = frozenset(getattr(engine, "capabilities", ()))
        except BaseException as exc:  # noqa: BLE001 - reported to the starter
            self._error = exc
            log.error("engine_load_failed", error=str(exc), exc_info=True)
            self._started.set()
            return
        self._ready.set()
        self._started.set()
        log.info("engine_ready", parallel=self.parallel, queue_size=self.queue_size)
        if self._on_ready:
            self._on_ready()
        active: list[_Active] = []
        idle_work = getattr(engine, "idle_work", None)
        idle_left = False  # the engine has idle work to do (Engine.idle_work)
        try:
            while True:
                to_open: list[Job] = []
                with self._lock:
                    if self._stopping:
                        break
                    self._expire_pending()
                    while self._pending and len(active) + len(to_open) < self.parallel:
                        to_open.append(self._pending.popleft())
                    calls = list(self._calls)
                    self._calls.clear()
                    idle = not active and not to_open and not calls
                    waited = idle and not (idle_left and idle_work is not None)
                    if waited:
                        self._wake.wait(HEARTBEAT_SECONDS)
                if not idle:
                    idle_left = True  # requests ran: they may leave a context to absorb
                elif not waited:
                    # one short piece (a draft forward of a few tokens), then look for work again:
                    # a request arriving meanwhile waits at most that piece
                    try:
                        idle_left = bool(idle_work())  # type: ignore[misc]
                    except Exception:  # an optimisation: never let it take the loop down
                        log.warning("idle_work_failed", exc_info=True)
                        idle_left = False
                for fn, out in calls:
                    try:
                        out.put((True, fn(engine)))
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        out.put((False, exc))
                for job in to_open:
                    self._open(engine, job, active)
                for a in list(active):
                    self._step(engine, a, active)
                with self._lock:
                    self._active_n = len(active)
                if self._on_heartbeat:  # progress made, or an idle wait came round: healthy
                    self._on_heartbeat()
        except BaseException as exc:  # noqa: BLE001 - the loop itself must not die silently
            log.error("engine_loop_crashed", error=str(exc), exc_info=True)
            self._error = exc
        finally:
            self._shutdown(engine, active)

    def _expire_pending(self) -> None:
        """Queued jobs whose caller went away or whose deadline passed leave the queue now."""
        now = time.monotonic()
        keep: collections.deque[Job] = collections.deque()
        for job in self._pending:
            if job.cancelled or job.expired(now):
                self._finish_unstarted(job, self._stop_reason(job, now))
            else:
                keep.append(job)
        self._pending = keep

    @staticmethod
    def _stop_reason(job: Job, now: float) -> str:
        """A passed deadline also cancels the RPC: report it as the deadline."""
        return "deadline" if job.expired(now) else "cancelled"

    def _finish_unstarted(self, job: Job, reason: str) -> None:
        job.finished = time.monotonic()
        res = GenerationResult(text="", token_ids=[], finish_reason=reason, prompt_tokens=0, stats=SpecStats())
        self.counters[f"finished_{reason}"] += 1
        if self._metrics is not None:
            self._metrics.requests.inc(label=reason)
        job.events.put(("result", res))

    def _open(self, engine: Any, job: Job, active: list[_Active]) -> None:
        now = time.monotonic()
        if job.cancelled or job.expired(now):
            self._finish_unstarted(job, self._stop_reason(job, now))
            return
        job.started = now
        try:
            if job.messages:
                text = engine.chat_prompt(list(job.messages))
                ids = engine.tokenize(text, add_special=True, parse_special=True)
            else:
                ids = engine.tokenize(job.prompt, add_special=True, parse_special=False)
            job.prompt_tokens = len(ids)
            req = GenerationRequest(
                prompt_tokens=tuple(ids), sampling=job.sampling, speculation=job.speculation,
                request_id=job.request_id, logprobs=job.logprobs, constraint=job.constraint,
            )
            session = engine.open_session(req)
        except BaseException as exc:  # noqa: BLE001 - BadRequest etc. go back to the caller
            job.finished = time.monotonic()
            job.events.put(("error", exc))
            return
        fields = {"prompt": job.prompt} if self._log_text and job.prompt else {}
        log.info("generation_started", request_id=job.request_id, prompt_tokens=len(ids),
                 mode=job.speculation.mode, queue_seconds=round(now - job.submitted, 4), **fields)
        active.append(_Active(job, session))

    def _step(self, engine: Any, a: _Active, active: list[_Active]) -> None:
        job, sess = a.job, a.session
        now = time.monotonic()
        if job.cancelled or job.expired(now):
            self._end(a, active, close_reason=self._stop_reason(job, now))
            return
        try:
            chunk: Chunk = sess.step()
        except BaseException as exc:  # noqa: BLE001 - one bad request must not take the daemon down
            log.error("generation_failed", request_id=job.request_id, error=str(exc), exc_info=True)
            try:
                sess.close("error")
            except BaseException:  # noqa: BLE001
                pass
            active.remove(a)
            job.finished = time.monotonic()
            self.counters["finished_error"] += 1
            job.events.put(("error", exc))
            return
        if chunk.token_ids and job.first_token is None:
            job.first_token = time.monotonic()
        job.events.put(("chunk", chunk))
        state = getattr(sess, "breaker_state", None) or getattr(engine, "breaker_state", None)
        if isinstance(state, str):
            self.breaker_state = state
        if sess.done or chunk.finish_reason:
            self._end(a, active, close_reason=None)

    def _end(self, a: _Active, active: list[_Active], close_reason: str | None) -> None:
        job, sess = a.job, a.session
        active.remove(a)
        result: GenerationResult | None = None
        try:
            if close_reason is None:
                result = sess.result()
                sess.close()
            else:
                sess.close(close_reason)
                result = sess.result()
        except BaseException as exc:  # noqa: BLE001
            log.error("session_close_failed", request_id=job.request_id, error=str(exc), exc_info=True)
        if result is None:
            result = GenerationResult("", [], close_reason or "error", job.prompt_tokens, SpecStats())
        if close_reason is not None and result.finish_reason != close_reason:
            result.finish_reason = close_reason  # type: ignore[assignment]
        job.finished = time.monotonic()
        self.counters[f"finished_{result.finish_reason}"] += 1
        self.counters["generated_tokens_total"] += len(result.token_ids)
        st = result.stats
        self.counters["target_forwards_total"] += st.target_forwards
        self.counters["drafted_tokens_total"] += st.drafted_tokens
        self.counters["accepted_tokens_total"] += st.accepted_tokens
        self.counters["breaker_transitions_total"] += st.breaker_transitions
        t = job.timings()
        if self._metrics is not None:
            ttft = t["time_to_first_token_seconds"] if job.first_token else None
            self._metrics.on_finish(result, ttft, t["total_seconds"])
        fields = {"text": result.text} if self._log_text else {}
        log.info("generation_finished", request_id=job.request_id, finish_reason=result.finish_reason,
                 completion_tokens=len(result.token_ids), tau=round(st.tau, 3),
                 ttft_seconds=round(t["time_to_first_token_seconds"], 4), total_seconds=round(t["total_seconds"], 4), **fields)
        job.events.put(("result", result))

    def _shutdown(self, engine: Any, active: list[_Active]) -> None:
        for a in list(active):
            self._end(a, active, close_reason="cancelled")
        with self._lock:
            self._active_n = 0
            pending, self._pending = list(self._pending), collections.deque()
            calls, self._calls = list(self._calls), collections.deque()
            self._stopping = True
        for job in pending:
            job.finished = time.monotonic()
            job.events.put(("error", NotReady("the server is shutting down")))
        for _fn, out in calls:
            out.put((False, NotReady("the server is shutting down")))
        try:
            engine.close()
        except BaseException as exc:  # noqa: BLE001
            log.warning("engine_close_failed", error=str(exc))
        log.info("engine_stopped")
