"""The requests in the engine's slots, on the engine thread: a job opened into a session, every
session advanced by one engine tick, the chunks handed to each job's queue, and a session ended
(finished, cancelled, past its deadline, or failed) with its result and its metrics."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from edgespec.errors import BadRequest, ForwardAborted, NotReady
from edgespec.logs import get_logger
from edgespec.server.loop_abort import AbortWatch
from edgespec.server.loop_audit import ShadowAudit
from edgespec.server.loop_contract import Job, LoopEngine, LoopSession
from edgespec.server.loop_intake import finish_unstarted
from edgespec.server.metrics import Metrics
from edgespec.types import Chunk, FinishReason, GenerationRequest, GenerationResult, SpecStats

log = get_logger("edgespec.server.engine")


@dataclass
class Figures:
    """The engine's figures as of its last tick, a snapshot for the handler threads."""

    tick_totals: dict[str, float] = field(default_factory=dict)  # the engine's tick phase totals
    suffix_cache: dict[str, Any] = field(default_factory=dict)  # the suffix cache's stats
    breaker_state: str = ""  # the last auto request's breaker state ("": none ran yet)
    aborted_ticks: int = 0  # ticks the abort watch stopped


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


class Running:
    """The jobs in `engine`'s sessions (`active`), advanced one tick at a time under `watch`;
    what they finish as goes to `metrics`, `audit` and `figures`. `log_text`: log prompts and
    outputs."""

    def __init__(self, engine: LoopEngine, *, metrics: Metrics, audit: ShadowAudit, watch: AbortWatch,
                 figures: Figures, log_text: bool = False):
        self.engine = engine
        self.metrics, self.audit, self.watch, self.figures = metrics, audit, watch, figures
        self.log_text = log_text
        self.active: list[_Active] = []

    def open(self, job: Job) -> None:
        """`job`'s session opened (it then takes part in the next tick), or its error answered."""
        now = time.monotonic()
        if job.cancelled or job.expired(now):
            finish_unstarted(job, job.stop_reason(now), self.metrics)
            return
        job.started = now
        try:
            if job.prompt_tokens is None:  # the handler tokenises with the engine's encoder
                raise NotReady("the request reached the engine untokenised: the model's encoder was not loaded")
            job.prompt_tokens = tuple(job.prompt_tokens)
            req = GenerationRequest(
                prompt_tokens=job.prompt_tokens, sampling=job.sampling, speculation=job.speculation,
                request_id=job.request_id, logprobs=job.logprobs, constraint=job.constraint, caller=job.caller,
                matcher=job.matcher,
            )
            session = self.engine.open_session(req)
        except BaseException as exc:  # BadRequest etc. go back to the caller
            job.finish()
            job.answer("error", exc)
            return
        fields = {"prompt": job.prompt} if self.log_text and job.prompt else {}
        log.info("generation_started", request_id=job.request_id, prompt_tokens=len(job.prompt_tokens),
                 mode=job.speculation.mode, queue_seconds=round(now - job.submitted, 4), **fields)
        self.active.append(_Active(job, session))
        job.opened.set()

    def expire(self) -> None:
        """Cancelled and expired sessions end before the next tick (a prefill in pieces too: a
        caller's deadline is honoured between pieces)."""
        now = time.monotonic()
        for a in list(self.active):
            if a.job.cancelled or a.job.expired(now):
                self._end(a, close_reason=a.job.stop_reason(now))

    def tick(self) -> None:
        """One engine tick over every active session; hand out the chunks."""
        try:
            with self.watch.over([a.job for a in self.active]):
                chunks = self.engine.tick([a.session for a in self.active])
        except ForwardAborted:
            # every request in the tick was cancelled or past its deadline: they end as such
            self.figures.aborted_ticks += 1
            now = time.monotonic()
            for a in list(self.active):
                self._end(a, close_reason=a.job.stop_reason(now))
            return
        except BaseException as exc:  # a failed tick must not take the daemon down
            self._fail(exc)
            return
        self.figures.tick_totals = dict(self.engine.tick_totals)  # a snapshot for the handler threads
        self.figures.suffix_cache = self.engine.suffix_stats()
        self._hand_out(chunks)

    def cancel_all(self) -> None:
        """The loop stops: every active request ends as cancelled."""
        for a in list(self.active):
            self._end(a, close_reason="cancelled")

    def _hand_out(self, chunks: Mapping[LoopSession, Chunk]) -> None:
        by_session = {a.session: a for a in self.active}
        for sess, chunk in chunks.items():
            a = by_session[sess]
            job = a.job
            if chunk.token_ids and job.first_token is None:
                job.first_token = time.monotonic()
            job.emitted += len(chunk.token_ids)
            if chunk.token_ids or chunk.text or chunk.finish_reason:
                job.events.put(("chunk", chunk))
            if sess.breaker_state is not None:  # an auto request's breaker: the gauge's current state
                self.figures.breaker_state = sess.breaker_state
            if sess.done or chunk.finish_reason:
                self._end(a, close_reason=None)

    def _fail(self, exc: BaseException) -> None:
        """The tick failed: every request in it ends with its error."""
        log.error("generation_failed", request_ids=[a.job.request_id for a in self.active], error=str(exc),
                  exc_info=True)
        for a in list(self.active):
            try:
                a.session.close("error")
            except BaseException:
                pass
            self.active.remove(a)
            a.job.finish(charged=True)
            self.metrics.requests.inc(label="error")
            a.job.answer("error", exc)

    def _close(self, a: _Active, close_reason: FinishReason | None) -> GenerationResult:
        """`a`'s session closed (`close_reason`: why it stops early; None: it finished), and its result."""
        job, sess = a.job, a.session
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
        self.figures.suffix_cache = self.engine.suffix_stats()  # the reply went into the cache as it closed
        if result is None:
            result = GenerationResult("", [], close_reason or "error", len(job.prompt_tokens or ()), SpecStats())
        if close_reason is not None and result.finish_reason != close_reason:
            result.finish_reason = close_reason
        return result

    def _end(self, a: _Active, close_reason: FinishReason | None) -> None:
        job = a.job
        self.active.remove(a)
        result = self._close(a, close_reason)
        job.emitted = max(job.emitted, len(result.token_ids))
        job.finish(charged=True)
        if job.shadow_of is not None:
            self.audit.verdict(job, result)
            return
        self.audit.offer(job, result)
        st = result.stats
        t = job.timings()
        ttft = t["time_to_first_token_seconds"] if job.first_token else None
        self.metrics.on_finish(result, ttft, t["total_seconds"])
        fields = {"text": result.text} if self.log_text else {}
        log.info("generation_finished", request_id=job.request_id, finish_reason=result.finish_reason,
                 completion_tokens=len(result.token_ids), tau=round(st.tau, 3),
                 ttft_seconds=round(t["time_to_first_token_seconds"], 4), total_seconds=round(t["total_seconds"], 4),
                 **fields)
        kind, value = _outcome(job, a.session, result)
        job.answer(kind, value)
