"""The engine loop over a batched engine (the fake backend of tests/fake_backend.py: the real
tick, the real sessions, scripted logits): admission counts jobs being opened, a cancel or a
deadline ends a request between its prefill pieces, streams keep flowing during a long prefill.
Synchronised on the engine's own ticks, never on the clock."""

from __future__ import annotations

import threading
import time

from edgespec.errors import Overloaded
from edgespec.sampling import SamplingParams
from edgespec.server.engine_loop import EngineLoop, Job
from edgespec.server.metrics import Metrics
from edgespec.types import SpeculationParams
from tests.fake_backend import fake_engine


class Hooked:
    """A fake-backend engine whose every tick first calls `before_tick(sessions)`."""

    def __init__(self, **kw):
        self.eng = fake_engine(**kw)
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
    loop = EngineLoop(lambda: fake_engine(parallel=2), parallel=2, queue_size=4, metrics=metrics).start()
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
        for line in ("edgespec_submitted_requests_total 1", 'edgespec_rejected_requests_total{reason="overloaded"} 1',
                     'edgespec_requests_total{finish_reason="length"} 1', "edgespec_generated_tokens_total 3",
                     f"edgespec_target_forwards_total {res.stats.target_forwards}"):
            assert line in body, line
    finally:
        eng.gate.set()
        loop.stop()
