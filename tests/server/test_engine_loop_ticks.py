"""The engine loop over a batched engine (the fake backend of tests/fake_backend.py: the real
tick, the real sessions, scripted logits): admission counts jobs being opened, a cancel or a
deadline ends a request between its prefill pieces, streams keep flowing during a long prefill.
Synchronised on the engine's own ticks, never on the clock."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import structlog
import structlog.testing

from edgespec.errors import Overloaded
from edgespec.sampling import SamplingParams
from edgespec.server.engine_loop import EngineLoop, Job
from edgespec.server.metrics import Metrics
from edgespec.types import SpeculationParams
from tests.fake_backend import fake_backed_engine


class Hooked:
    """A fake-backend engine whose every tick first calls `before_tick(sessions)`."""

    def __init__(self, **kw):
        self.eng = fake_backed_engine(**kw)
        self.before_tick = lambda sessions: None
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.eng, name)

    def warmup(self):
        pass

    def tick(self, sessions):
        self.gate.wait(10)
        self.before_tick(sessions)
        return self.eng.tick(sessions)


def start(engine, parallel, queue_size=4):
    loop = EngineLoop(lambda: engine, parallel=parallel, queue_size=queue_size).start()
    assert loop.wait_loaded(10)
    return loop


@contextlib.contextmanager
def engine_thread_held(loop):
    """Hold the engine thread in an engine call for the block's duration (waited for, not slept
    on): what the block submits is admitted together when it ends."""
    inside, release = threading.Event(), threading.Event()
    caller = threading.Thread(target=loop.call, args=(lambda engine: inside.set() or release.wait(30),))
    caller.start()
    assert inside.wait(10)
    try:
        yield
    finally:
        release.set()
        caller.join(30)


def job(tokens, max_tokens=8, **kw) -> Job:
    j = Job(request_id=f"r{len(tokens)}", sampling=SamplingParams(max_tokens=max_tokens),
            speculation=SpeculationParams(mode="plain"), **kw)
    j.prompt_tokens = tuple(tokens)
    return j


def events(j: Job, timeout=20.0):
    out = []
    while True:
        kind, value = j.events.get(timeout=timeout)
        out.append((kind, value))
        if kind in ("result", "error"):
            return out


def test_admission_counts_jobs_being_opened():
    """parallel 2 + queue 4 admit exactly 6 of 30 jobs submitted at once (the loop was holding
    jobs it had taken from the queue but not yet opened outside both counts)."""
    eng = Hooked(parallel=2)
    eng.gate.clear()  # the engine thread blocks in its first tick: slots full, queue filling
    loop = start(eng, parallel=2, queue_size=4)
    try:
        accepted, refused = [], 0
        first = [loop.submit(job([0, 5, 6], max_tokens=50)) for _ in range(2)]
        # wait until the engine thread has taken both into sessions (it is now stuck in tick)
        deadline = time.monotonic() + 10
        while loop.stats()["active_requests"] < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        for _ in range(28):
            try:
                accepted.append(loop.submit(job([0, 7], max_tokens=2)))
            except Overloaded as e:
                refused += 1
                assert "2 active and 4 queued" in str(e)
        assert len(first) + len(accepted) == 6 and refused == 24
        eng.gate.set()
        for j in first + accepted:
            assert events(j)[-1][0] == "result"
    finally:
        eng.gate.set()
        loop.stop()


def test_cancel_between_prefill_pieces():
    eng = Hooked(parallel=2, n_ctx=1024)
    long_job = job([0] + [5] * 700, max_tokens=4)

    def cancel_after_first_piece(sessions):
        for s in sessions:
            if s.n_prompt > 100 and s.prefill_pos > 0:
                long_job.cancel()

    eng.before_tick = cancel_after_first_piece
    loop = start(eng, parallel=2)
    try:
        loop.submit(long_job)
        res = events(long_job)[-1]
        assert res[0] == "result" and res[1].finish_reason == "cancelled" and res[1].token_ids == []
        assert eng.free_slots == 2
        small = loop.submit(job([0, 9], max_tokens=3))
        assert events(small)[-1][1].finish_reason in ("length", "eos")
    finally:
        loop.stop()


def test_deadline_between_prefill_pieces():
    eng = Hooked(parallel=2, n_ctx=1024)
    long_job = job([0] + [5] * 700, max_tokens=4)

    def expire_after_first_piece(sessions):
        for s in sessions:
            if s.n_prompt > 100 and s.prefill_pos > 0:
                long_job.deadline = time.monotonic() - 1

    eng.before_tick = expire_after_first_piece
    loop = start(eng, parallel=2)
    try:
        loop.submit(long_job)
        res = events(long_job)[-1]
        assert res[1].finish_reason == "deadline"
    finally:
        loop.stop()


def _hold_forward_until_aborted(ctx, expire=None, seconds: float = 30.0):
    """The fake target's forwards of prompt pieces (> 50 tokens) run until the context is
    aborted, as a long llama_decode would: the loop's watch must abort them. `expire()` runs as
    such a forward starts (the deadline passing or the caller cancelling meanwhile)."""
    held: list[Any] = []

    def before(tokens):
        if len(tokens) > 50 and not held:
            held.append(time.monotonic())
            if expire is not None:
                expire()
            end = time.monotonic() + seconds
            while not ctx.aborted and time.monotonic() < end:
                time.sleep(0.001)
            held.append(time.monotonic())

    ctx.before_decode = before
    return held


def test_a_deadline_passing_inside_a_forward_aborts_it():
    """Alone in the engine, a long prompt's piece is one long forward: when the request's
    deadline passes inside it, the watch aborts the forward (engine.abort_forward) instead of
    letting it run to the end, the request ends as "deadline", and the next request is served."""
    eng = Hooked(parallel=2, n_ctx=1024)
    long_job = job([0] + [5] * 700, max_tokens=4)
    held = _hold_forward_until_aborted(eng.eng.target_ctx,
                                       expire=lambda: setattr(long_job, "deadline", time.monotonic() + 0.05))
    loop = start(eng, parallel=2)
    try:
        loop.submit(long_job)
        assert events(long_job)[-1][1].finish_reason == "deadline"
        assert len(held) == 2 and held[1] - held[0] < 20, "the forward ran to its end: not aborted"
        assert loop.aborted_ticks == 1
        assert eng.free_slots == 2  # the aborted session's slot is free and emptied
        assert all(not s.target.ctx.tokens_of(s.target.base) for s in eng.eng.slots)
        small = loop.submit(job([0, 9], max_tokens=3))
        assert events(small)[-1][1].finish_reason in ("length", "eos")
    finally:
        loop.stop()


def test_a_cancel_aborts_the_forward_only_when_every_request_in_it_is_gone():
    """Two requests share the tick; cancelling one leaves the forward running (the other still
    wants it); cancelling both aborts it."""
    eng = Hooked(parallel=2, n_ctx=1024)
    a = job([0] + [5] * 300, max_tokens=4)
    b = job([0] + [6] * 300, max_tokens=4)
    gate = threading.Event()

    def expire():
        a.cancel()
        gate.set()

    held = _hold_forward_until_aborted(eng.eng.target_ctx, expire=expire, seconds=1.0)
    firsts: list[int] = []
    eng.before_tick = lambda sessions: firsts.append(len(sessions))
    loop = start(eng, parallel=2)
    try:
        with engine_thread_held(loop):  # both queued while the engine thread is busy: one tick opens both
            loop.submit(a)
            loop.submit(b)
        assert gate.wait(20)
        assert firsts[0] == 2  # the premise: a and b share the held forward
        # only a was cancelled: the held forward runs its full second, unaborted
        assert events(a)[-1][1].finish_reason == "cancelled"
        assert held[1] - held[0] >= 0.9
        assert loop.aborted_ticks == 0
        assert events(b)[-1][1].finish_reason in ("length", "eos")
    finally:
        loop.stop()


def test_streams_get_tokens_while_a_long_prompt_is_prefilled():
    eng = Hooked(parallel=2, n_ctx=1024)
    prefill_ticks, stream_tokens = [], []
    stream = job([0, 5, 6], max_tokens=400)
    long_queued = threading.Event()

    def watch(sessions):
        short = [s for s in sessions if s.n_prompt < 100]
        if not long_queued.is_set() and short and short[0].out:
            # the stream is flowing: hold it here until the long prompt is queued (the fake
            # engine would otherwise finish its 400 tokens before the test thread submits it)
            assert long_queued.wait(10), "the long prompt was never queued"
        long = [s for s in sessions if s.n_prompt > 100]
        if long and long[0].prefilling:
            prefill_ticks.append(long[0].prefill_pos)
            stream_tokens.append(len(short[0].out) if short else None)

    eng.before_tick = watch
    loop = start(eng, parallel=2)
    try:
        loop.submit(stream)
        kind, _ = stream.events.get(timeout=10)  # the stream's first token
        assert kind == "chunk"
        long_job = loop.submit(job([0] + [8] * 700, max_tokens=2))
        long_queued.set()
        events(long_job)
        stream.cancel()
        events(stream)
        during = [t for t in stream_tokens if t is not None]
        assert len(prefill_ticks) >= 3  # the prompt took several ticks
        assert len(during) == len(prefill_ticks)  # the stream was in every one of them
        assert during == sorted(during) and during[-1] - during[0] >= len(during) - 1  # a token every tick
    finally:
        long_queued.set()
        loop.stop()


def test_breaker_gauge_reports_the_last_auto_requests_state():
    metrics = Metrics()
    loop = EngineLoop(lambda: fake_backed_engine(parallel=2), parallel=2, queue_size=4, metrics=metrics).start()
    metrics.state = loop.stats
    try:
        assert loop.wait_loaded(10)
        assert "edgespec_breaker_state{" not in metrics.render()  # no auto request yet: no state
        events(loop.submit(job([0, 5, 6], max_tokens=2)))  # a plain request has no breaker
        assert "edgespec_breaker_state{" not in metrics.render()
        auto = job([0, 5, 6], max_tokens=8)
        auto.speculation = SpeculationParams(mode="auto")
        assert events(loop.submit(auto))[-1][0] == "result"
        body = metrics.render()
        for line in ('edgespec_breaker_state{state="closed"} 1', 'edgespec_breaker_state{state="open"} 0',
                     'edgespec_breaker_state{state="half_open"} 0'):
            assert line in body, line
    finally:
        loop.stop()


def test_stats_and_metrics_count_from_one_set_of_counters():
    """Admin.Stats' totals are the /metrics counters: an admitted request, a refusal and a
    finished request show the same in both."""
    metrics = Metrics()
    eng = Hooked(parallel=1)
    loop = EngineLoop(lambda: eng, parallel=1, queue_size=0, metrics=metrics).start()
    try:
        assert loop.wait_loaded(10)
        eng.gate.clear()  # the engine thread blocks in the first request's tick: the slot is full
        first = loop.submit(job([0, 5, 6], max_tokens=3))
        while loop.stats()["active_requests"] < 1:
            eng.gate.wait(0.005)
        try:
            loop.submit(job([0, 7], max_tokens=2))
        except Overloaded:
            pass
        eng.gate.set()
        res = events(first)[-1][1]
        s = loop.stats()
        assert s["requests_total"] == 1 and s["rejected_overloaded_total"] == 1
        assert s["finished_length"] == 1 and s["generated_tokens_total"] == len(res.token_ids) == 3
        assert s["target_forwards_total"] == res.stats.target_forwards
        body = metrics.render()
        m = 'model=""'  # a loop on its own: no chat model's name (the daemon's loops count under theirs)
        for line in (f"edgespec_submitted_requests_total{{{m}}} 1", f'edgespec_rejected_requests_total{{{m},reason="overloaded"}} 1',
                     f'edgespec_requests_total{{finish_reason="length",{m}}} 1', f"edgespec_generated_tokens_total{{{m}}} 3",
                     f"edgespec_target_forwards_total{{{m}}} {res.stats.target_forwards}"):
            assert line in body, line
    finally:
        eng.gate.set()
        loop.stop()


def _wait(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_audit_shadow_decodes_match_and_a_tampered_one_is_counted():
    """[audit] shadow_fraction = 1: each finished greedy speculative request is re-decoded in plain
    mode once the engine is idle, and counted a match; a shadow whose recorded output was tampered
    with (what a drifting speculative path would leave) is counted a mismatch and logged with the
    audited request's id. Plain requests and T > 0 requests are not audited."""
    eng = Hooked(parallel=2, n_ctx=1024)
    loop = EngineLoop(lambda: eng, parallel=2, queue_size=4, shadow_fraction=1.0, seed=1).start()
    assert loop.wait_loaded(10)
    try:
        greedy = job([0, 5, 6, 7], max_tokens=6)
        greedy.sampling = SamplingParams(max_tokens=6, temperature=0.0)
        greedy.speculation = SpeculationParams(mode="chain")
        old = structlog.get_config()
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
        try:
            with structlog.testing.capture_logs() as logged:
                loop.submit(greedy)
                assert events(greedy)[-1][0] == "result"
                assert _wait(lambda: any(e["event"] == "audit_shadow_match" for e in logged))
        finally:
            structlog.configure(**old)
        assert loop.metrics.shadow.value("match") == 1
        match = next(e for e in logged if e["event"] == "audit_shadow_match")
        # the shadow really decoded plainly: plain steps only, no draft forward
        assert match["draft_forwards"] == 0 and set(match["steps_per_mode"]) == {"plain"}, match
        plain = job([0, 5, 6, 8], max_tokens=6)
        plain.sampling = SamplingParams(max_tokens=6, temperature=0.0)
        hot = job([0, 5, 6, 9], max_tokens=6)
        hot.sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        hot.speculation = SpeculationParams(mode="tree")
        for j in (plain, hot):
            loop.submit(j)
            events(j)
        audit = loop._audit
        queue_shadow = audit.offer

        def tamper(j, result):  # the recorded output of "audited-1" is not what plain decodes
            queue_shadow(j, result)
            if j.request_id == "audited-1":
                with audit.lock:
                    s = audit.waiting[-1]
                    rid, out = s.shadow_of
                    s.shadow_of = (rid, tuple(out[:-1]) + ((out[-1] + 1) % 97,))

        audit.offer = tamper
        tampered = job([0, 5, 6, 7], max_tokens=6)
        tampered.request_id = "audited-1"
        tampered.sampling = SamplingParams(max_tokens=6, temperature=0.0)
        tampered.speculation = SpeculationParams(mode="tree")
        loop.submit(tampered)
        events(tampered)
        assert _wait(lambda: loop.metrics.shadow.value("mismatch") + loop.metrics.shadow.value("match") >= 2)
        assert loop.metrics.shadow.value("match") == 1 and loop.metrics.shadow.value("mismatch") == 1
        totals = loop.stats()
        assert totals["audit_shadow_checks_total"] == 2 and totals["audit_shadow_mismatches_total"] == 1
        assert "edgespec_audit_shadow_checks_total{model=\"\",result=\"mismatch\"} 1" in loop.metrics.render()
    finally:
        loop.stop()
