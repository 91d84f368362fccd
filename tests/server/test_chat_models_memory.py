"""The memory plan against the process's resident size: loading the demo's whole stack
(configs/demo.toml: the default chat model with its draft and EAGLE-3 head, its Q8_0 twin as a
second chat model, the embedding and rerank contexts) grows the process's RSS by no more than the
plan counts for them, and by not much less: the plan bounds what loading takes without
overstating it wildly. The prompt and suffix caches' bounds are left out of the comparison: the
plan reserves them, and they fill only with traffic. Slow: CI runs it."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from edgespec.server.chat_plan import models_plan
from edgespec.server.config import load
from edgespec.server.daemon import Daemon

pytestmark = pytest.mark.slow
DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"
# loading takes at least this share of what the plan counts (measured on a CPU: 0.82 of it)
MIN_SHARE = 0.6


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_loading_the_demo_stack_grows_the_resident_size_within_its_plan(demo_pair):
    cfg = load(DEMO, env={})
    default, twin = cfg.chat_entries()
    plan = models_plan(cfg.engine, [twin], cfg.models.memory_bytes, cfg.embedding, cfg.rerank,
                       default_name=default.name)
    planned = {name: p.total_bytes - p.cache_bytes for name, p, _ in plan.chat}
    planned["embedding and rerank"] = plan.side_bytes
    daemon = Daemon(cfg)
    models = daemon.chat_models
    grown: dict[str, int] = {}
    gc.collect()
    before = last = _rss()
    try:
        models.start()
        assert daemon.loop.wait_loaded(900)
        grown[default.name], last = _rss() - last, _rss()
        with models.use(models.by_name[twin.name], None):
            grown[twin.name], last = _rss() - last, _rss()
        assert daemon.embedder is not None and daemon.reranker is not None
        daemon.embedder.embed(["Name three colours."])  # each context made on its first request
        daemon.reranker.score("colours", ["red, green and blue", "a car"])
        grown["embedding and rerank"] = _rss() - last
        total = _rss() - before
    finally:
        daemon.shutdown(grace=0)
    figures = {k: f"{grown[k] >> 20} MiB resident of {planned[k] >> 20} MiB planned" for k in planned}
    for k in planned:
        assert grown[k] <= planned[k], figures
    assert MIN_SHARE * sum(planned.values()) <= total <= sum(planned.values()) <= plan.all_bytes, figures
