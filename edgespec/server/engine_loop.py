"""The ONE engine thread. It owns the llama.cpp contexts (all engine calls happen here), admits
jobs from a bounded queue into up to `parallel` sessions, and runs engine ticks: each tick
advances every active session by one step in one batched target forward (edgespec/tick/), and
prefills new prompts in pieces alongside. Chunks go to a per-job unbounded queue: the engine
never waits for a reader (output is bounded by max_tokens). Cancel and deadline are checked
between ticks, so a cancelled request stops within one tick and frees its slot, a prefill too; and,
with an engine that can abort a forward (`abort_forward`: the patched llama.cpp's abort flag), a
watch thread stops a tick within one graph node once every request in it is cancelled or past its
deadline (a lone long prompt read in whole n_batch pieces), so the next request starts at once."""

from __future__ import annotations

import collections
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from edgespec import chat
from edgespec.errors import BadRequest, ForwardAborted, NotReady, Overloaded
from edgespec.logs import get_logger
from edgespec.sampling import SamplingParams
from edgespec.server.metrics import Metrics
from edgespec.types import Chunk, GenerationRequest, GenerationResult, SpecStats, SpeculationParams

log = get_logger("edgespec.server.engine")


class LoopSession(Protocol):
    """What the loop needs of one request's session (edgespec.session.Session)."""

    breaker_state: str | None  # an auto request's breaker state, None otherwise

    @property
    def done(self) -> bool: ...

    def result(self) -> GenerationResult: ...

    def close(self, reason: str | None = None) -> None: ...


class CallerPlace(Protocol):
    """A request's place under its caller's limits (edgespec.server.callers.Place)."""

    state: str  # "queued", "running" or "released"

    def start(self) -> bool: ...  # queued -> running if the caller is under its concurrent limit

    def release(self) -> None: ...  # the job left its slot or the queue

    def used(self, tokens: int) -> None: ...  # tokens the job cost, charged to its caller's window


@runtime_checkable
class LoopEngine(Protocol):
    """What the loop needs of an engine (edgespec.engine.Engine; the tests' FakeEngine). All of
    it runs on the loop's thread, except `encoder`, which the handler threads use, and
    `abort_forward`, which the abort watch calls. The optional capabilities are members too:
    a method, or None on an engine without it (the loop asks nothing else of an engine)."""

    capabilities: frozenset[str]  # "constraint", "logprobs": what requests may ask of it
    tick_totals: Mapping[str, float]  # seconds per tick phase, ticks, ... since load

    @property
    def encoder(self) -> Any: ...  # the thread-safe tokenizer and chat template (backend.Model), or None

    def warmup(self) -> None: ...

    def open_session(self, req: GenerationRequest) -> LoopSession: ...

    def tick(self, sessions: Sequence[LoopSession]) -> Mapping[LoopSession, Chunk]: ...

    def idle_work(self) -> bool: ...  # one piece of background work; True while more is left

    def close(self) -> None: ...

    # an engine whose encoder is None tokenises its jobs itself (chat.ChatTokenizer)
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]: ...

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> str: ...

    # optional: stop the forward in progress at its next graph node, from any thread (the tick
    # then raises ForwardAborted); None: a cancelled request waits for its tick's end
    @property
    def abort_forward(self) -> Callable[[], None] | None: ...

    # optional: stop idle work's forward at its next graph node, from any thread (True), and
    # lower that flag again on the engine thread (False); None: a job arriving during idle time
    # waits for the piece in progress
    @property
    def abort_idle_work(self) -> Callable[[bool], None] | None: ...

    # optional: the suffix cache's figures, read after each tick and as a request closes
    @property
    def suffix_stats(self) -> Callable[[], dict[str, float]] | None: ...

    # the suffix cache on or off (off empties it) and/or emptied (SetPolicy, a reload); its figures
    def suffix_control(self, enabled: bool | None = None, clear: bool = False) -> dict: ...


def _shadow_fields(result: GenerationResult) -> dict:
    """How an [audit] shadow decoded, for its log line: plain steps only and no draft forward is
    what makes it a check."""
    return {"steps_per_mode": dict(result.stats.steps_per_mode), "draft_forwards": result.stats.draft_forwards}


HEARTBEAT_SECONDS = 1.0
BLOCKED_SECONDS = 0.01  # idle with queued jobs whose callers are at their concurrent limit
WATCH_SECONDS = 0.005  # how often the watch thread looks at a running tick's requests


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
    session: LoopSession


def _outcome(job: Job, sess: Any, result: GenerationResult) -> tuple[str, Any]:
    """A finished job's last event: its result, or the error of a request that failed on its own
    (its grammar past the engine's limits: Session.failure), named by the field its constraint
    came from. The others in the tick go on."""
    failure = getattr(sess, "failure", None)
    return ("error", BadRequest(job.constraint_field, failure)) if failure else ("result", result)


class EngineLoop:
    """`factory()` builds the engine *on the engine thread* (then `warmup()`); jobs go in with
    `submit`, one-off engine calls (tokenize, model_info) with `call`."""

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
        self.breaker_state = ""  # the last auto request's breaker state ("": none ran yet)
        # what the loaded engine applies beyond plain generation ("constraint"): its `capabilities`
        # attribute; the APIs refuse a request needing one it lacks
        self.capabilities: frozenset[str] = frozenset()
        self.encoder: Any = None  # set on the engine thread once the engine is built (see _run)
        # the engine's thread-safe constraint compiler (Engine.compile_constraint), or None
        self._compile: Callable[[Any], Any] | None = None
        self.tick_totals: dict[str, float] = {}  # the engine's tick phase totals, after each tick
        self.suffix_cache: dict[str, float] = {}  # the engine's suffix cache stats, after each tick
        self._idle_done = False  # no job, no call and no idle work left (see _run)
        # a piece of idle work is running (under _lock); a job or call arriving meanwhile stops it
        # (the engine's abort_idle_work) and _idle_stopped says that one did
        self._idling = False
        self._idle_stopped = False
        self._arrivals = 0  # jobs and calls submitted so far (see _idle_piece)
        self._abort_idle: Callable[[bool], None] | None = None
        self._thread = threading.Thread(target=self._run, name="edgespec-engine", daemon=True)
        # the abort watch: the jobs of the tick in progress (None between ticks), under _watch_lock
        self._watch_lock = threading.Lock()
        self._watch_jobs: list[Job] | None = None
        self._watch_wake = threading.Event()
        self._abort: Callable[[], None] | None = None
        self._suffix_stats: Callable[[], dict[str, float]] | None = None  # the engine's, if it has them
        self.aborted_ticks = 0
        # [audit]: finished greedy speculative requests waiting for their plain shadow decode
        self.shadow_fraction = shadow_fraction
        self._shadows: collections.deque[Job] = collections.deque(maxlen=shadow_queue)
        self._rng = random.Random(seed)

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
                self.metrics.rejected.inc(label="overloaded")
                raise Overloaded(
                    f"server busy: {self._active_n} active and {len(self._pending)} queued "
                    f"(parallel={self.parallel}, queue_size={self.queue_size})"
                )
            job.queued = len(self._pending) + self._active_n >= self.parallel
            self._pending.append(job)
            self._idle_done = False
            self.metrics.submitted.inc()
            self._stop_idle()
            self._wake.notify()
        return job

    def _stop_idle(self) -> None:
        """A job or call arrived: stop the piece of idle work in progress (under _lock)."""
        self._arrivals += 1
        if self._idling and not self._idle_stopped and self._abort_idle is not None:
            self._idle_stopped = True
            self._abort_idle(True)

    def call(self, fn: Callable[[Any], Any], timeout: float | None = 60.0) -> Any:
        """Run `fn(engine)` on the engine thread and return its result (or raise its exception)."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            if self._stopping:
                raise NotReady("the server is shutting down")
            if not self._ready.is_set():
                raise NotReady("the models are still loading")
            self._calls.append((fn, out))
            self._stop_idle()
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
                "breaker_state": self.breaker_state,
                "tick_totals": self.tick_totals,
                "suffix_cache": self.suffix_cache,
                "proposed_by_source": {k: int(v) for k, v in self.metrics.proposed_by_source.values().items()},
                "accepted_by_source": {k: int(v) for k, v in self.metrics.accepted_by_source.values().items()},
                "idle": self._idle_done and not self._pending and not self._active_n,
                **self.metrics.totals(),
            }

    def compile(self, constraint: Any) -> Any:
        """A request's constraint compiled in the calling handler thread (a grammar state for
        Job.matcher: one per job, it is stateful), or None when there is none or the engine
        compiles on its own thread; BadRequest naming the field when it does not compile. A
        large schema or grammar then costs its own caller the time, never the engine thread."""
        if constraint is None or self._compile is None:
            return None
        return self._compile(constraint)

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._factory()
            # the engine's thread-safe tokenizer and chat template, for the handler threads (None:
            # this engine has none; its jobs are then tokenised here, on the engine thread)
            self.encoder = engine.encoder
            self._compile = getattr(engine, "compile_constraint", None)
            engine.warmup()
            self.capabilities = frozenset(engine.capabilities)
        except BaseException as exc:  # reported to the starter
            self._error = exc
            log.error("engine_load_failed", error=str(exc), exc_info=True)
            self._started.set()
            return
        self._abort, self._suffix_stats = engine.abort_forward, engine.suffix_stats
        self._abort_idle = engine.abort_idle_work
        if self._abort is not None:
            threading.Thread(target=self._watch, name="edgespec-abort-watch", daemon=True).start()
        self._ready.set()
        self._started.set()
        log.info("engine_ready", parallel=self.parallel, queue_size=self.queue_size)
        if self._on_ready:
            self._on_ready()
        active: list[_Active] = []
        idle_work = engine.idle_work
        idle_left = False  # the engine has idle work to do (Engine.idle_work)
        try:
            while True:
                to_open: list[Job] = []
                with self._lock:
                    if self._stopping:
                        break
                    self._expire_pending()
                    self._admit(len(active), to_open)
                    if not active and not to_open and not self._calls and self._shadows:
                        to_open.append(self._shadows.popleft())  # idle: one audit shadow decode
                    # jobs being opened hold their slot already: admission counts them
                    self._active_n = len(active) + len(to_open)
                    calls = list(self._calls)
                    self._calls.clear()
                    idle = not active and not to_open and not calls
                    looked = self._arrivals
                    waited = idle and not idle_left
                    self._idle_done = waited and not self._pending
                    if waited:
                        # queued jobs left while slots are free wait for their callers' places
                        # (an embedding's, released off this thread): look again soon
                        self._wake.wait(BLOCKED_SECONDS if self._pending else HEARTBEAT_SECONDS)
                if not idle:
                    idle_left = True  # requests ran: they may leave a context to absorb
                elif not waited:
                    # one short piece (a draft forward of a few tokens), then look for work again:
                    # a request arriving meanwhile stops the piece (_stop_idle), or waits for it
                    # on an engine that cannot abort one
                    idle_left = self._idle_piece(idle_work, looked)
                for fn, out in calls:
                    try:
                        out.put((True, fn(engine)))
                    except BaseException as exc:  # handed to the caller
                        out.put((False, exc))
                for job in to_open:
                    self._open(engine, job, active)
                self._expire_active(active)
                if active:
                    self._tick(engine, active)
                with self._lock:
                    self._active_n = len(active)
                if self._on_heartbeat:  # progress made (one tick), or an idle wait came round
                    self._on_heartbeat()
        except BaseException as exc:  # the loop itself must not die silently
            log.error("engine_loop_crashed", error=str(exc), exc_info=True)
            self._error = exc
        finally:
            self._shutdown(engine, active)
            self._watch_wake.set()

    def _idle_piece(self, idle_work: Callable[[], bool], looked: int) -> bool:
        """One piece of the engine's idle work, stoppable by a job or call arriving meanwhile
        (`looked`: the arrivals the loop had seen); whether more is left."""
        with self._lock:
            if self._arrivals != looked:
                return True  # something came since the loop looked: it goes round to it first
            self._idling = True
        try:
            return bool(idle_work())
        except Exception:  # an optimisation: never let it take the loop down
            log.warning("idle_work_failed", exc_info=True)
            return False
        finally:
            with self._lock:
                self._idling, stopped = False, self._idle_stopped
                self._idle_stopped = False
            if stopped and self._abort_idle is not None:  # no one raises the flag again now
                self._abort_idle(False)

    def _watch(self) -> None:
        """While a tick runs: abort its forward once every request in it is cancelled or past its
        deadline (the engine then raises ForwardAborted and _tick closes them)."""
        abort = self._abort
        assert abort is not None  # started only for an engine that can abort a forward
        while not self._stopping:
            self._watch_wake.wait()
            while not self._stopping:
                with self._watch_lock:
                    jobs = self._watch_jobs
                    if jobs is None:
                        self._watch_wake.clear()
                        break
                    now = time.monotonic()
                    if jobs and all(j.cancelled or j.expired(now) for j in jobs):
                        abort()  # again each round: a tick clears it as it starts
                time.sleep(WATCH_SECONDS)

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

    def _admit(self, n_active: int, to_open: list[Job]) -> None:
        """Free slots go to the queued jobs in order, each once its caller is under its
        concurrent limit (`CallerPlace.start`): a job waiting for its own caller's slot does not
        hold back another caller's. Under self._lock."""
        if not self._pending or n_active >= self.parallel:
            return
        keep: collections.deque[Job] = collections.deque()
        while self._pending:
            job = self._pending.popleft()
            if n_active + len(to_open) >= self.parallel:
                keep.append(job)
            elif job.place is None or job.place.start():
                to_open.append(job)
            elif job.place.state == "released":  # its handler gave up on it: it never runs
                job.cancel()
                self._finish_unstarted(job, "cancelled")
            else:
                keep.append(job)
        self._pending = keep

    def _expire_active(self, active: list[_Active]) -> None:
        """Cancelled and expired sessions end before the next tick (a prefill in pieces too: a
        caller's deadline is honoured between pieces)."""
        now = time.monotonic()
        for a in list(active):
            if a.job.cancelled or a.job.expired(now):
                self._end(a, active, close_reason=self._stop_reason(a.job, now))

    @staticmethod
    def _stop_reason(job: Job, now: float) -> str:
        """A passed deadline also cancels the RPC: report it as the deadline."""
        return "deadline" if job.expired(now) else "cancelled"

    def _finish_unstarted(self, job: Job, reason: str) -> None:
        job.finish()
        res = GenerationResult(text="", token_ids=[], finish_reason=reason, prompt_tokens=0, stats=SpecStats())
        self.metrics.requests.inc(label=reason)
        job.events.put(("result", res))
        job.opened.set()  # after its answer: a reader of `opened` finds it

    def _open(self, engine: LoopEngine, job: Job, active: list[_Active]) -> None:
        now = time.monotonic()
        if job.cancelled or job.expired(now):
            self._finish_unstarted(job, self._stop_reason(job, now))
            return
        job.started = now
        try:
            if job.prompt_tokens is not None:  # tokenised by the caller's thread (the daemon's way)
                ids = list(job.prompt_tokens)
            else:  # an engine without an encoder: the engine itself is the tokenizer
                ids = chat.encode_prompt(engine, job.prompt, job.messages)
            job.prompt_tokens = tuple(ids)
            req = GenerationRequest(
                prompt_tokens=tuple(ids), sampling=job.sampling, speculation=job.speculation,
                request_id=job.request_id, logprobs=job.logprobs, constraint=job.constraint, caller=job.caller,
                matcher=job.matcher,
            )
            session = engine.open_session(req)
        except BaseException as exc:  # BadRequest etc. go back to the caller
            job.finish()
            job.events.put(("error", exc))
            job.opened.set()
            return
        fields = {"prompt": job.prompt} if self._log_text and job.prompt else {}
        log.info("generation_started", request_id=job.request_id, prompt_tokens=len(ids),
                 mode=job.speculation.mode, queue_seconds=round(now - job.submitted, 4), **fields)
        active.append(_Active(job, session))
        job.opened.set()

    def _tick(self, engine: LoopEngine, active: list[_Active]) -> None:
        """One engine tick over every active session; hand out the chunks."""
        by_session = {a.session: a for a in active}
        with self._watch_lock:
            self._watch_jobs = [a.job for a in active]
        self._watch_wake.set()
        try:
            try:
                chunks = engine.tick([a.session for a in active])
            finally:
                with self._watch_lock:
                    self._watch_jobs = None
        except ForwardAborted:
            # every request in the tick was cancelled or past its deadline: they end as such
            self.aborted_ticks += 1
            now = time.monotonic()
            for a in list(active):
                self._end(a, active, close_reason=self._stop_reason(a.job, now))
            return
        except BaseException as exc:  # a failed tick must not take the daemon down
            log.error("generation_failed", request_ids=[a.job.request_id for a in active], error=str(exc),
                      exc_info=True)
            for a in list(active):
                try:
                    a.session.close("error")
                except BaseException:
                    pass
                active.remove(a)
                a.job.finish(charged=True)
                self.metrics.requests.inc(label="error")
                a.job.events.put(("error", exc))
                a.job.opened.set()
            return
        self.tick_totals = dict(engine.tick_totals)  # a snapshot for the handler threads
        if self._suffix_stats is not None:
            self.suffix_cache = self._suffix_stats()
        for sess, chunk in chunks.items():
            a = by_session[sess]
            job = a.job
            if chunk.token_ids and job.first_token is None:
                job.first_token = time.monotonic()
            job.emitted += len(chunk.token_ids)
            if chunk.token_ids or chunk.text or chunk.finish_reason:
                job.events.put(("chunk", chunk))
            if sess.breaker_state is not None:  # an auto request's breaker: the gauge's current state
                self.breaker_state = sess.breaker_state
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
        except BaseException as exc:
            log.error("session_close_failed", request_id=job.request_id, error=str(exc), exc_info=True)
        if self._suffix_stats is not None:  # the request's reply went into the cache as it closed
            self.suffix_cache = self._suffix_stats()
        if result is None:
            result = GenerationResult("", [], close_reason or "error", len(job.prompt_tokens or ()), SpecStats())
        if close_reason is not None and result.finish_reason != close_reason:
            result.finish_reason = close_reason  # type: ignore[assignment]
        job.emitted = max(job.emitted, len(result.token_ids))
        job.finish(charged=True)
        if job.shadow_of is not None:
            self._shadow_done(job, result)
            return
        self._maybe_shadow(job, result)
        st = result.stats
        t = job.timings()
        ttft = t["time_to_first_token_seconds"] if job.first_token else None
        self.metrics.on_finish(result, ttft, t["total_seconds"])
        fields = {"text": result.text} if self._log_text else {}
        log.info("generation_finished", request_id=job.request_id, finish_reason=result.finish_reason,
                 completion_tokens=len(result.token_ids), tau=round(st.tau, 3),
                 ttft_seconds=round(t["time_to_first_token_seconds"], 4), total_seconds=round(t["total_seconds"], 4), **fields)
        job.events.put(_outcome(job, sess, result))
        job.opened.set()

    def _maybe_shadow(self, job: Job, result: GenerationResult) -> None:
        """[audit]: queue a plain re-decode of a finished greedy speculative request (a fraction
        of them), to run when the engine is idle."""
        if (self.shadow_fraction <= 0 or job.speculation.mode == "plain" or job.sampling.temperature > 1e-5
                or result.finish_reason not in ("length", "eos", "stop") or not job.prompt_tokens
                or self._rng.random() >= self.shadow_fraction):
            return
        shadow = Job(request_id=f"shadow-{job.request_id}", sampling=job.sampling,
                     speculation=SpeculationParams(mode="plain"), constraint=job.constraint,
                     prompt_tokens=job.prompt_tokens, shadow_of=(job.request_id, tuple(result.token_ids)))
        with self._lock:
            if len(self._shadows) == self._shadows.maxlen:
                self.metrics.shadow.inc(label="skipped")
            self._shadows.append(shadow)

    def _shadow_done(self, job: Job, result: GenerationResult) -> None:
        rid, expected = job.shadow_of  # type: ignore[misc]
        if result.finish_reason not in ("length", "eos", "stop"):  # cancelled by a drain: not a verdict
            self.metrics.shadow.inc(label="skipped")
            return
        if tuple(result.token_ids) == expected:
            self.metrics.shadow.inc(label="match")
            log.info("audit_shadow_match", request_id=rid, tokens=len(expected), **_shadow_fields(result))
            return
        k = next((i for i, (a, b) in enumerate(zip(result.token_ids, expected)) if a != b),
                 min(len(expected), len(result.token_ids)))
        self.metrics.shadow.inc(label="mismatch")
        log.warning("audit_shadow_mismatch", request_id=rid, first_differing_token=k,
                    speculative_tokens=len(expected), plain_tokens=len(result.token_ids), **_shadow_fields(result))

    def _shutdown(self, engine: LoopEngine, active: list[_Active]) -> None:
        for a in list(active):
            self._end(a, active, close_reason="cancelled")
        with self._lock:
            self._active_n = 0
            pending, self._pending = list(self._pending), collections.deque()
            calls, self._calls = list(self._calls), collections.deque()
            self._stopping = True
        for job in pending:
            job.finish()
            job.events.put(("error", NotReady("the server is shutting down")))
            job.opened.set()
        for _fn, out in calls:
            out.put((False, NotReady("the server is shutting down")))
        try:
            engine.close()
        except BaseException as exc:
            log.warning("engine_close_failed", error=str(exc))
        log.info("engine_stopped")
