"""A grammar that fails while its request runs (past llguidance's limits, or its masks past the
step's time budget) fails that request with an error naming the field its constraint came from;
the request beside it in the same ticks ends as usual. A grammar merely costly over its run is
paced to its share instead (it sits out ticks), ending as usual or at its deadline. The real
Engine on the fake backend, in the real EngineLoop (the HTTP and gRPC APIs map the error: tests/server/test_probes_e2e.py)."""

from __future__ import annotations

import string
import threading
import time

import pytest

from edgespec.constraint import Compiler, MaskLimits, Matcher, Vocabulary
from edgespec.errors import BadRequest
from edgespec.sampling import SamplingParams
from edgespec.server import pipe
from edgespec.server.engine_loop import EngineLoop, Job
from edgespec.types import ConstraintSpec, SpeculationParams
from tests import fake_backend
from tests.test_constraint import _Slow

pytest.importorskip("llguidance")

PIECES = [" ", ".", "ab", "ba", "abc", *string.ascii_letters, *string.digits][:fake_backend.VOCAB - 2]
REGEX = ConstraintSpec("regex", "[abc]+")


@pytest.fixture
def loop(monkeypatch):
    monkeypatch.setattr(fake_backend, "FakeModel", fake_backend.piece_model(PIECES))
    engine = fake_backend.fake_backed_engine(parallel=2)
    lp = EngineLoop(lambda: engine, parallel=2, queue_size=2).start()
    assert lp.wait_loaded(30)
    yield lp, engine
    lp.stop()


def _events(job: Job) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    try:
        for event in pipe.job_events(job.events, stopped=lambda: False):
            out.append(event)
    except BadRequest as exc:
        out.append(("error", exc))
    return out


def test_a_grammar_failing_mid_run_is_that_requests_error_naming_its_field(loop):
    lp, engine = loop
    matcher = Compiler(Vocabulary.from_model(engine.target)).matcher(ConstraintSpec("regex", "[abc]+"))
    commit = matcher.commit

    def commit_then_too_costly(tokens):  # after the first step's tokens, every step's masks are too costly
        commit(tokens)
        matcher.step_seconds = 0.0

    matcher.commit = commit_then_too_costly
    prompt = tuple(engine.target.tokenize("ab ab", True, False))
    sampling = SamplingParams(max_tokens=12)
    failing = Job(request_id="grammar", sampling=sampling, speculation=SpeculationParams(mode="tree"),
                  prompt_tokens=prompt, constraint=ConstraintSpec("regex", "[abc]+"), matcher=matcher,
                  constraint_field="response_format")
    other = Job(request_id="plain", sampling=sampling, speculation=SpeculationParams(mode="tree"), prompt_tokens=prompt)
    lp.submit(failing)
    lp.submit(other)
    got, beside = _events(failing), _events(other)
    kind, err = got[-1]
    assert kind == "error" and isinstance(err, BadRequest), got
    assert err.field == "response_format" and "token masks took over 0 s" in str(err), str(err)
    assert "failed after" in str(err) and not str(err).startswith("response_format: the constraint failed after 0 ")
    assert beside[-1][0] == "result" and beside[-1][1].finish_reason == "length"
    assert len(beside[-1][1].token_ids) == 12
    assert lp.ready  # the loop goes on


class _Costly(_Slow):
    """tests/test_constraint.py's slow matcher (every mask costs `seconds` of the calling
    thread's, the engine thread's, CPU time) that also records that thread's CPU clock at each
    mask, and `beside()`."""

    def __init__(self, m, seconds: float):
        super().__init__(m, seconds)
        self.clock: list[tuple[float, bool]] = []  # (the engine thread's CPU clock, beside()) at each mask
        self.beside = lambda: False

    def unsafe_compute_mask_ptr(self, ptr, nbytes):
        self.spend()
        self.clock.append((time.thread_time(), self.beside()))
        return self._m.unsafe_compute_mask_ptr(ptr, nbytes)


def _costly(engine, limits: MaskLimits, seconds: float) -> tuple[Matcher, _Costly]:
    m = Compiler(Vocabulary.from_model(engine.target), limits).matcher(REGEX)
    m._m = costly = _Costly(m._m, seconds)
    return m, costly


def _job(engine, name: str, matcher=None, max_tokens: int = 30, **kw) -> Job:
    prompt = tuple(engine.target.tokenize("ab ab", True, False))
    constrained = {"constraint": REGEX, "matcher": matcher, "constraint_field": "response_format"} if matcher else {}
    return Job(request_id=name, sampling=SamplingParams(max_tokens=max_tokens), speculation=SpeculationParams(mode="plain"),
               prompt_tokens=prompt, **constrained, **kw)


def _both(first: Job, second: Job) -> tuple[list, list]:
    """Both jobs' events, read side by side."""
    out: dict[str, list] = {}
    readers = [threading.Thread(target=lambda j=j: out.__setitem__(j.request_id, _events(j))) for j in (first, second)]
    for r in readers:
        r.start()
    for r in readers:
        r.join(60)
    return out[first.request_id], out[second.request_id]


def _served_meanwhile(long: Job) -> bool:
    """The long request was still running and had been served (the held one did not stall it);
    it is cancelled now, which ends it."""
    running, emitted = long.finished is None, long.emitted
    long.cancel()
    kind, result = _events(long)[-1]
    return running and emitted >= 5 and kind == "result" and getattr(result, "finish_reason", None) == "cancelled"


def test_a_grammar_costing_thrice_its_share_is_paced_to_it_not_failed(loop):
    """Masks of 12 ms a step beside a request whose ticks take about 4 ms (3 ms of them its own
    cheap grammar's masks): together the costly masks would take three quarters of the engine
    thread, three times the share of 0.25. The request sits out ticks while its bucket refills
    (its slot kept) and ends normally; while the other ran, its masks took at most the burst and
    its share of the engine thread's time (and one step). The cheap grammar beside it is never
    held and finishes first; then, alone, the costly one is held no more. (Before: past its share
    it failed with a 400.)"""
    lp, engine = loop
    limits = MaskLimits(step_seconds=0.5, tick_seconds=0.5, burst_seconds=0.02, share=0.25)
    costly, clock = _costly(engine, limits, 0.012)
    cheap, _ = _costly(engine, MaskLimits(), 0.003)
    slow_job, cheap_job = _job(engine, "costly", costly), _job(engine, "cheap", cheap)
    clock.beside = lambda: cheap_job.finished is None  # read on the engine thread, at each mask
    lp.submit(slow_job)
    lp.submit(cheap_job)
    slow, beside = _both(slow_job, cheap_job)
    assert slow[-1][0] == "result" and slow[-1][1].finish_reason == "length", slow[-1]
    assert beside[-1][0] == "result" and beside[-1][1].finish_reason == "length", beside[-1]
    assert costly.failure is None and costly.deferred > 0
    assert cheap.deferred == 0 and cheap_job.finished < slow_job.finished
    shared = [t for t, other_running in clock.clock if other_running]
    assert 2 <= len(shared) < 30, len(shared)  # paced: 30 steps unpaced
    engine_seconds = shared[-1] - shared[0]  # the engine thread's CPU time while both ran
    assert 0.012 * (len(shared) - 1) <= 0.02 + 0.25 * engine_seconds + 0.012 + 0.003, (len(shared), engine_seconds)


def test_a_request_held_for_its_share_past_its_deadline_ends_as_deadline(loop):
    """A grammar whose share refills far slower than a 0.3 s deadline (its first step empties the
    bucket; refilling it takes 1 s of engine time), beside a long request: it sits out ticks and
    its deadline ends it, finish_reason "deadline", while the other goes on. (Before: it failed
    past its share with a 400.)"""
    lp, engine = loop
    costly, _ = _costly(engine, MaskLimits(burst_seconds=0.0, share=0.01), 0.010)
    other, _ = _costly(engine, MaskLimits(burst_seconds=10.0, share=0.9), 0.004)  # ~ 4 ms a tick: a long run
    held = _job(engine, "held", costly, deadline=time.monotonic() + 0.3)
    long = _job(engine, "long", other, max_tokens=200)
    lp.submit(held)
    lp.submit(long)
    got = _events(held)
    assert got[-1][0] == "result" and got[-1][1].finish_reason == "deadline", got[-1]
    assert costly.deferred > 0 and costly.failure is None
    assert _served_meanwhile(long)


def test_a_request_held_past_the_longest_wait_fails_naming_its_field(loop):
    """The same grammar with no deadline, waiting at most 0.2 s for one step: it fails with a 400
    naming its field (the slot is not held forever)."""
    lp, engine = loop
    costly, _ = _costly(engine, MaskLimits(burst_seconds=0.0, share=0.01, wait_seconds=0.2), 0.010)
    other, _ = _costly(engine, MaskLimits(burst_seconds=10.0, share=0.9), 0.004)
    held, long = _job(engine, "held", costly), _job(engine, "long", other, max_tokens=200)
    lp.submit(held)
    lp.submit(long)
    kind, err = _events(held)[-1]
    assert kind == "error" and isinstance(err, BadRequest) and err.field == "response_format", (kind, err)
    assert "waited over 0.2 s for their share" in str(err)
    assert _served_meanwhile(long)


def test_one_mask_past_the_step_bound_still_fails_its_request(loop):
    """Pacing is for the run: one step whose masks take longer than the step's bound (60 ms
    against 50 ms) is a grammar too costly to apply, and fails at once, however roomy its share."""
    lp, engine = loop
    costly, _ = _costly(engine, MaskLimits(step_seconds=0.05, burst_seconds=10.0, share=0.9), 0.06)
    failing, other = _job(engine, "costly", costly), _job(engine, "plain", max_tokens=12)
    lp.submit(failing)
    lp.submit(other)
    got, beside = _both(failing, other)
    kind, err = got[-1]
    assert kind == "error" and isinstance(err, BadRequest), got[-1]
    assert "took over 0.05 s of one decoding step" in str(err) and costly.deferred == 0
    assert beside[-1][0] == "result" and len(beside[-1][1].token_ids) == 12
