"""Shared fixtures: the real demo models (prepared once from the package registry) and a loaded
engine. Tests that use them are end-to-end and marked slow; CI runs them."""

from __future__ import annotations

import pytest

from edgespec.models import DemoPair


@pytest.fixture(scope="session")
def demo_pair() -> DemoPair:
    from edgespec.models import prepare_demo

    return prepare_demo()


@pytest.fixture(scope="session")
def engine(demo_pair: DemoPair):
    from edgespec.config import EngineConfig, ModelConfig
    from edgespec.engine import Engine

    cfg = EngineConfig(
        target=ModelConfig(path=str(demo_pair.target), n_ctx=2048),
        draft=ModelConfig(path=str(demo_pair.draft), n_ctx=2048),
        parallel=2,
        # the engine tests measure the draft model's acceptance and reproduce seeded runs; the
        # suffix cache (which replays earlier answers) has its own tests (tests/drafters/test_suffix.py)
        suffix_cache=False,
        # tests empty the slots' caches (Slot.reset) to start from nothing; the prompt store, which
        # would hand a dropped prefill back, has its own (tests/heads/test_engine_dual.py)
        prompt_cache_bytes=0,
    )
    eng = Engine.load(cfg)
    yield eng
    eng.close()
