"""At startup the daemon refuses a configuration that does not fit its device, with the plan's
explanation (edgespec.plan), before loading anything."""

from __future__ import annotations

import pytest

from edgespec.config import EngineConfig, ModelConfig
from edgespec.errors import ConfigError
from edgespec.server.daemon import check_memory

pytestmark = pytest.mark.slow


def test_refuses_a_config_that_does_not_fit(demo_pair):
    huge = EngineConfig(
        target=ModelConfig(str(demo_pair.target), n_ctx=1 << 20),
        draft=ModelConfig(str(demo_pair.draft), n_ctx=1 << 20),
        parallel=64,
    )
    with pytest.raises(ConfigError) as e:
        check_memory(huge)
    assert e.value.key == "engine"
    assert "RAM" in str(e.value)


def test_accepts_the_demo_config(demo_pair):
    check_memory(EngineConfig(ModelConfig(str(demo_pair.target)), ModelConfig(str(demo_pair.draft))))
