"""The suffix cache as the daemon reports and controls it, over the fake backend: the caller's
identity reaches the cache's partition, Admin.Stats' source of it (EngineLoop.stats) holds the
cache's stats and the draft tokens by source, /metrics renders them, SetPolicy's clear and a
reload's `suffix_cache = false` empty it."""

from __future__ import annotations

from edgespec.sampling import SamplingParams
from edgespec.server.engine_loop import EngineLoop, Job
from edgespec.types import SpeculationParams
from tests.fake_backend import fake_backed_engine


class Warm:
    def __init__(self):
        self.eng = fake_backed_engine(parallel=1)

    def __getattr__(self, name):
        return getattr(self.eng, name)

    def warmup(self):
        pass


def run(loop, caller, tokens=(0, 5, 9, 14)):
    j = Job(request_id="r", sampling=SamplingParams(max_tokens=30), speculation=SpeculationParams(mode="auto"),
            caller=caller)
    j.prompt_tokens = tuple(tokens)
    loop.submit(j)
    while True:
        kind, value = j.events.get(timeout=10)
        if kind != "chunk":
            assert kind == "result", value
            return value


def test_stats_metrics_partitions_and_clearing():
    engine = Warm()
    loop = EngineLoop(lambda: engine, parallel=1, queue_size=4).start()
    loop.metrics.state = loop.stats  # as the daemon wires them
    try:
        assert loop.wait_loaded(10)
        run(loop, "token:alice")
        again = run(loop, "token:alice")
        assert again.stats.accepted_by_source.get("suffix", 0) > 0
        other = run(loop, "token:bob")
        assert "suffix" not in other.stats.proposed_by_source
        s = loop.stats()
        assert s["suffix_cache"]["documents"] == 3 and s["suffix_cache"]["partitions"] == 2
        assert s["suffix_cache"]["bytes"] <= s["suffix_cache"]["max_bytes"]
        assert s["accepted_by_source"]["suffix"] == again.stats.accepted_by_source["suffix"]
        text = loop.metrics.render()
        assert 'edgespec_accepted_tokens_by_source_total{model="",source="suffix"}' in text
        assert "edgespec_suffix_cache_documents 3" in text
        assert loop.call(lambda e: e.suffix_control(clear=True))["documents"] == 0
        assert loop.call(lambda e: e.suffix_control(enabled=False))["enabled"] is False
        assert "suffix" not in run(loop, "token:alice").stats.proposed_by_source
    finally:
        loop.stop()
