"""engine_loop.LoopEngine states what the loop asks of an engine: the real Engine (over the fake
backend) and the tests' FakeEngine both are one, optional capabilities included (a method, or
None), and the loop uses what an engine has without probing it."""

from __future__ import annotations

import threading

from edgespec.engine import Engine
from edgespec.server.engine_loop import EngineLoop, LoopEngine
from tests.fake_backend import fake_engine
from tests.server.fake_engine import FakeEngine


def _watching() -> bool:
    return any(t.name == "edgespec-abort-watch" and t.is_alive() for t in threading.enumerate())


def test_the_engine_and_the_fake_are_loop_engines():
    real: LoopEngine = fake_engine(parallel=1)  # a type checker checks these assignments too
    fake: LoopEngine = FakeEngine()
    assert isinstance(real, Engine) and isinstance(real, LoopEngine)
    assert isinstance(fake, LoopEngine)
    assert callable(real.abort_forward) and callable(real.suffix_stats) and callable(real.abort_idle_work)
    assert isinstance(real.suffix_stats(), dict)
    assert fake.abort_forward is None and fake.suffix_stats is None
    real.close()


def test_an_engine_missing_a_member_is_not_one():
    class NoTick(FakeEngine):
        tick = None  # a required method set to None is missing

    class Bare:
        capabilities = frozenset()

    assert not isinstance(Bare(), LoopEngine)
    del FakeEngine.abort_forward  # the optional capability must still be stated (as None)
    try:
        assert not isinstance(FakeEngine(), LoopEngine)
    finally:
        FakeEngine.abort_forward = None
    assert not isinstance(NoTick(), LoopEngine)


def test_the_loop_watches_ticks_only_for_an_engine_that_can_abort_a_forward():
    for engine, watched in ((FakeEngine(), False), (fake_engine(parallel=1), True)):
        before = _watching()
        loop = EngineLoop(lambda e=engine: e, parallel=1, queue_size=1).start()
        try:
            assert loop.wait_loaded(10)
            assert _watching() == (watched or before)
        finally:
            loop.stop()
