"""engine_loop.LoopEngine states what the loop and the daemon ask of an engine: the real Engine
(over the fake backend) and the tests' FakeEngine both are one, every member present (none is
optional), and the loop uses them without probing."""

from __future__ import annotations

import threading
from typing import Any

from edgespec.engine import Engine
from edgespec.sampling import SamplingParams
from edgespec.server.engine_loop import EngineLoop, Job, LoopEngine
from edgespec.session import Session
from edgespec.types import SpeculationParams
from tests.fake_backend import fake_backed_engine
from tests.fake_engine import FakeEngine


def _watches() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "edgespec-abort-watch" and t.is_alive()]


def test_the_engine_and_the_fake_are_loop_engines() -> None:
    fake: LoopEngine[Any] = FakeEngine()  # mypy checks these assignments (a typed test): the whole
    real: LoopEngine[Session] = fake_backed_engine(parallel=1)  # Protocol, over each one's sessions
    assert isinstance(real, Engine) and isinstance(real, LoopEngine)
    assert isinstance(fake, LoopEngine)
    engines: tuple[Any, ...] = (real, fake)  # and what the test asks beyond the Protocol
    for engine in engines:
        assert callable(engine.abort_forward) and callable(engine.abort_idle_work)
        assert callable(engine.compile_constraint) and isinstance(engine.suffix_stats(), dict)
        assert engine.encoder is not None and engine.suffix_cache.save is not None
        # whole as the real one is: its encoder tokenises as it does, its suffix cache answers
        assert engine.encoder.tokenize("ab", add_special=False) == engine.tokenize("ab", add_special=False)
        assert engine.suffix_control(clear=True) == engine.suffix_stats()
        assert engine.suffix_stats()["documents"] == 0
    real.close()


def test_an_engine_missing_a_member_is_not_one():
    class NoTick(FakeEngine):
        tick = None  # a required method set to None is missing

    class Bare:
        capabilities = frozenset()

    class NoAbort(FakeEngine):
        abort_forward = None  # once optional: now a member like any other

    no_cache = FakeEngine()
    del no_cache.suffix_cache
    assert not isinstance(Bare(), LoopEngine)
    assert not isinstance(NoTick(), LoopEngine) and not isinstance(NoAbort(), LoopEngine)
    assert not isinstance(no_cache, LoopEngine)


def test_the_loop_watches_the_ticks_of_every_engine_until_it_stops():
    for engine in (FakeEngine(), fake_backed_engine(parallel=1)):
        before = set(_watches())
        loop = EngineLoop(lambda e=engine: e, parallel=1, queue_size=1).start()
        try:
            assert loop.wait_loaded(10)
            watch = set(_watches()) - before
            assert len(watch) == 1
        finally:
            loop.stop()
        watch.pop().join(5)
        assert set(_watches()) <= before


def test_the_watch_aborts_the_fakes_tick_once_its_requests_are_gone():
    """The fake engine's forward is abortable as the real one's: a tick whose every request is
    cancelled stops at once, counted as an aborted tick, and the request ends as cancelled."""
    class Ticking(FakeEngine):
        def tick(self, sessions):
            ticking.set()
            return super().tick(sessions)

    ticking = threading.Event()
    engine = Ticking(parallel=1, step_seconds=30.0)  # one step: a forward that would take 30 s
    loop = EngineLoop(lambda: engine, parallel=1, queue_size=1).start()
    try:
        assert loop.wait_loaded(10)
        job = loop.submit(Job(request_id="r", sampling=SamplingParams(max_tokens=4),
                              speculation=SpeculationParams(mode="plain"), prompt_tokens=(1, 2, 3)))
        assert ticking.wait(10)
        job.cancel()
        kind, result = job.events.get(timeout=10)
        assert (kind, result.finish_reason) == ("result", "cancelled")
        assert loop.aborted_ticks == 1 and engine.aborts >= 1 and engine.busy == 0
    finally:
        loop.stop()
