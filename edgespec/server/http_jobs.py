"""A request's engine jobs as the HTTP handlers run them, without ever blocking the event loop:
admitted under the caller's own limits ([limits] caller_*), the prompt tokenised on a worker
thread (pipe.prompt_tokens, as gRPC does in its handler thread), a constraint compiled there too,
n choices submitted together as engine_loop.Jobs, a stream's jobs opened before its status line,
a unary job waited for (the client going away cancels it), and event batches read on a worker
thread, one hop per batch (pipe.next_events)."""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import structlog
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from edgespec import reasoning
from edgespec.errors import NotReady
from edgespec.server import openai_api as oa
from edgespec.server import pipe
from edgespec.server.callers import UNLIMITED, CallerLimits, Place, Unlimited, current_caller
from edgespec.server.engine_loop import EngineLoop, Job
from edgespec.types import GenerationResult

POLL_SECONDS = pipe.POLL_SECONDS  # how often a waiting request looks whether the engine is still there
OPEN_WAIT_SECONDS = 1.0  # a stream's status line waits this long at most for its jobs to be opened


@dataclasses.dataclass
class Run:
    """A request's jobs on their way: `events` a stream's one queue; `first` the events its jobs
    put while they were opened (None: a job waits in the queue)."""

    jobs: list[Job]
    events: queue.SimpleQueue
    first: list[tuple] | None
    created: int
    reasoning: reasoning.Reasoning | None = None  # the model thinks: its <think> block is split off


class _Tagged:
    """A streamed choice's event queue as its job sees it: each event goes, tagged with the
    choice's index, onto the stream's one queue (one waiting thread for all n choices)."""

    def __init__(self, shared: queue.SimpleQueue, index: int):
        self.shared, self.index = shared, index

    def put(self, event: tuple[str, Any]) -> None:
        self.shared.put((*event, self.index))


class HttpJobs:
    """The engine loop as the HTTP handlers reach it: `threads` worker threads at most wait on it."""

    def __init__(self, loop: EngineLoop, *, threads: int, chat_template: str = "",
                 callers: CallerLimits | None = None):
        self.loop = loop
        self.chat_template = chat_template  # [target] chat_template's text ("" = the GGUF's own)
        self.callers = callers  # per-caller limits and figures (shared with gRPC), None: no limits
        self.limiter = anyio.CapacityLimiter(threads)  # threads waiting on engine events
        self._vocab: list[bytes] | None = None  # token -> bytes (asked of the engine once)
        self._vocab_lock = threading.Lock()

    # ---- the engine, from the event loop -------------------------------------------------------

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), blocking, on a worker thread."""
        return await anyio.to_thread.run_sync(lambda: fn(*args), limiter=self.limiter)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """fn(engine) on the engine thread, without blocking the event loop."""
        return await anyio.to_thread.run_sync(self.loop.call, fn, limiter=self.limiter)

    async def vocabulary(self) -> list[bytes]:
        """Every token's bytes (for logprobs and /detokenize), read once: from the loaded target's
        thread-safe encoder when there is one, else on the engine thread."""
        if self._vocab is None:
            def read(src: Any) -> list[bytes]:
                model = src if hasattr(src, "piece") else getattr(src, "target", None)
                if model is not None and hasattr(model, "piece"):
                    return [model.piece(t) for t in range(int(model.n_vocab))]
                n = int(src.model_info().get("n_vocab", 0))
                return [src.detokenize([t]).encode() for t in range(n)]

            enc = self.loop.encoder
            if enc is not None and hasattr(enc, "piece"):
                got = await anyio.to_thread.run_sync(read, enc, limiter=self.limiter)
            else:
                got = await self.call(read)
            with self._vocab_lock:
                self._vocab = got
        return self._vocab

    async def prompt_tokens(self, req: oa.CompletionRequest, rendered: list[str] | None = None
                            ) -> tuple[int, ...]:
        """The prompt tokenised on a worker thread by pipe.prompt_tokens, as the gRPC servicer
        does: the engine thread gets token ids.
        `rendered`: the chat template's text is appended (when the Jinja template was rendered)."""
        return await self.run(lambda: pipe.prompt_tokens(
            self.loop, self.chat_template, req.prompt, req.messages, req.extras, req.tools,
            variables=dict(req.template_vars), jinja=req.reasons, rendered=rendered))

    async def events(self, events: queue.SimpleQueue, until_result: bool = False,
                     wait: float | None = None) -> list[tuple]:
        """The next batch of events from a job's queue, or a stream's ((kind, value, choice index)
        each): pipe.next_events in a worker thread, one thread hop per batch, not per chunk;
        raises the batch's first error (BadRequest from the engine, ...). [] when none came
        within `wait` seconds."""
        return list(pipe.raise_error(await anyio.to_thread.run_sync(lambda: pipe.next_events(
            events, until_result=until_result, stopped=lambda: self.loop.stopped, poll=POLL_SECONDS, wait=wait),
            limiter=self.limiter)))

    @staticmethod
    def check_end(result: GenerationResult) -> None:
        pipe.check_end(result, deadline="edgespec.timeout_seconds passed")

    async def stop_sequence(self, req: oa.CompletionRequest, result: GenerationResult) -> str | None:
        """The stop string that ended a result (finish reason "stop"): the one its tokens' text
        goes on with where the answer's text was cut."""
        stops = req.sampling.stop
        if result.finish_reason != "stop" or not stops:
            return None
        if len(stops) == 1:
            return stops[0]
        pieces = await self.vocabulary()
        full = b"".join(pieces[t] for t in result.token_ids if 0 <= t < len(pieces)).decode("utf-8", "replace")
        return next((s for s in stops if full.startswith(s, len(result.text))), None)

    # ---- admission -----------------------------------------------------------------------------

    async def admitted(self, run: Callable[[contextlib.ExitStack, Place | Unlimited], Awaitable[Response]]
                       ) -> Response:
        """run(hold, place) admitted under the caller's own limits ([limits] caller_*) for as long
        as it runs (a stream: until it ends; `hold` holds its places)."""
        hold = contextlib.ExitStack()
        place: Place | Unlimited = UNLIMITED
        if self.callers is not None:
            place = hold.enter_context(self.callers.admit(current_caller()))
        try:
            resp = await run(hold, place)
        except BaseException:
            hold.close()
            raise
        if not isinstance(resp, StreamingResponse):
            hold.close()
        return resp

    def admit_now(self) -> Any:
        """The caller's place for a request that runs at once, outside the engine's slots."""
        return self.callers.admit(current_caller(), queued=False) if self.callers is not None else \
            contextlib.nullcontext(UNLIMITED)

    # ---- a request's jobs ----------------------------------------------------------------------

    async def start(self, req: oa.CompletionRequest, rid: str, hold: contextlib.ExitStack,
                    place: Place | Unlimited, constraint_field: str = "constraint") -> Run:
        """The request's jobs submitted; a stream's, once they are open (see _opening). Its
        capabilities were checked (pipe.check_capabilities) by the route that parsed it."""
        deadline = time.monotonic() + req.timeout_seconds if req.timeout_seconds else None
        rendered: list[str] = []
        tokens = await self.prompt_tokens(req, rendered)
        created = int(time.time())
        thinking = reasoning.Reasoning(bool(rendered) and reasoning.opened(rendered[-1]), req.reasoning_budget) \
            if req.reasons else None
        sub = req
        if thinking is not None and (req.constraint is not None or thinking.budget is not None):
            # the constraint holds after the reasoning; the budget on it (edgespec/budget.py)
            calls = req.tools is not None and req.tools.calls_allowed
            inner = req.tools.constraint((reasoning.OPEN,)) if calls and req.tools is not None else req.constraint
            sub = dataclasses.replace(req, constraint=thinking.constraint(inner))
        # each choice's grammar state, compiled on a worker thread: neither this event loop nor
        # the engine thread waits for a large schema or grammar
        matchers = [await anyio.to_thread.run_sync(self.loop.compile, sub.constraint, limiter=self.limiter)
                    for _ in range(sub.n)] if sub.constraint is not None else [None] * sub.n
        jobs, events = self._submit(sub, rid, tokens, deadline, hold, place, matchers, constraint_field)
        first: list[tuple] | None = None
        if req.stream:
            try:
                first = await self._opening(jobs, events)
            except BaseException:
                for job in jobs:
                    job.cancel()
                raise
        return Run(jobs, events, first, created, thinking)

    def _submit(self, req: oa.CompletionRequest, rid: str, tokens: tuple[int, ...] | None, deadline: float | None,
                hold: contextlib.ExitStack, place: Place | Unlimited,
                matchers: Sequence[Any] = (), constraint_field: str = "constraint") -> tuple[list[Job], queue.SimpleQueue]:
        """The request's n jobs of the one prompt, submitted together (each its own slot and its own
        place under the caller's limits, `place` the first's; with a seed, choice i samples with
        seed + i).
        A stream's jobs put their events, tagged with the choice's index, on the one queue
        returned (a unary request's jobs keep their own)."""
        places = [place]
        if self.callers is not None:
            places += [hold.enter_context(self.callers.admit(current_caller())) for _ in range(req.n - 1)]
        else:
            places *= req.n
        caller = structlog.contextvars.get_contextvars().get("caller", "")
        shared: queue.SimpleQueue = queue.SimpleQueue()
        jobs: list[Job] = []
        try:
            for i in range(req.n):
                s = req.sampling if req.sampling.seed is None else \
                    dataclasses.replace(req.sampling, seed=(req.sampling.seed + i) % (1 << 63))
                # in flight until it ends, each choice holds its tokens (the prompt, once) against
                # the caller's tokens-per-minute limit; the engine charges what it cost as it ends
                places[i].reserve(len(tokens or ()) * (i == 0) + s.max_tokens)
                job = Job(request_id=f"{rid}.{i}" if i else rid, sampling=s, speculation=req.speculation,
                          prompt=req.prompt, messages=req.messages, prompt_tokens=tokens, logprobs=req.logprobs,
                          constraint=req.constraint, matcher=matchers[i] if matchers else None, deadline=deadline,
                          caller=caller, place=places[i], charge_prompt=i == 0, constraint_field=constraint_field)
                if req.stream:
                    job.events = _Tagged(shared, i)  # type: ignore[assignment]
                self.loop.submit(job)
                jobs.append(job)
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
        return jobs, shared

    async def _opening(self, jobs: Sequence[Job], events: queue.SimpleQueue) -> list[tuple] | None:
        """Before a stream's status line: the events its jobs put while the engine opened them
        (an error the engine raises then, a prompt too long say, is still a status code). None,
        and the status line at once, when a job waits in the queue (behind other requests, or
        for its caller's place for longer than OPEN_WAIT_SECONDS): the stream then begins with
        a keep-alive, and such an error comes as the stream's error event."""
        if any(job.queued for job in jobs):
            return None

        def wait() -> bool:
            until = time.monotonic() + OPEN_WAIT_SECONDS
            for job in jobs:
                while not job.opened.wait(POLL_SECONDS):
                    if self.loop.stopped:
                        raise NotReady("the engine stopped")
                    if time.monotonic() >= until:
                        return False
            return True

        if not await anyio.to_thread.run_sync(wait, limiter=self.limiter):
            return None
        got: list[tuple] = []
        with contextlib.suppress(queue.Empty):
            while True:
                got.append(events.get_nowait())
        return list(pipe.raise_error(got))

    async def results(self, request: Request, jobs: Sequence[Job]) -> list[GenerationResult]:
        """A unary request's results, one per choice; what is left unfinished is cancelled."""
        try:
            return [await self._unary(request, job) for job in jobs]
        finally:
            for job in jobs:
                if job.finished is None:
                    job.cancel()

    async def _unary(self, request: Request, job: Job) -> GenerationResult:
        """Wait for the result; the client going away cancels the job."""
        async def watch() -> None:
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    job.cancel()
                    return

        failed: Exception | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                try:  # raised outside the task group, or it would come wrapped in an ExceptionGroup
                    kind, value = (await self.events(job.events, until_result=True))[-1]
                except Exception as exc:  # re-raised below
                    failed = exc
                tg.cancel_scope.cancel()
            if failed is not None:
                raise failed
            self.check_end(value)
            return value
        finally:
            if job.finished is None:
                job.cancel()


__all__: Sequence[str] = ("OPEN_WAIT_SECONDS", "POLL_SECONDS", "HttpJobs", "Run")
