"""`MODE+suffix` bench modes (the suffix cache on for that mode only) and the report's warm-up
curve: the speedup over plain after 0, 10, 30 and 100 requests of the stream."""

from __future__ import annotations

from edgespec.bench import report as rep
from edgespec.bench.runner import Row, base_mode, parse_modes, request
from edgespec.bench.suite import load_suite


def test_suffix_modes_turn_the_cache_on_for_themselves_only():
    assert parse_modes("plain,auto,auto+suffix") == ("plain", "auto", "auto+suffix")
    assert base_mode("auto+suffix") == "auto" and base_mode("auto+schema+suffix") == "auto"
    assert request((1, 2), "auto+suffix", 8).speculation.suffix
    assert not request((1, 2), "auto", 8).speculation.suffix
    assert request((1, 2), "auto+suffix", 8).speculation.mode == "auto"


def row(i: int, mode: str, tps: float) -> Row:
    return Row(id=f"p{i}", category="repetitive-sql", mode=mode, tokens=64, seconds=64 / tps,
               tokens_per_second=tps, tau=1.0, target_forwards=64, index=i,
               proposed_by_source=(("suffix", 10),) if mode.endswith("+suffix") else (),
               accepted_by_source=(("suffix", 7),) if mode.endswith("+suffix") else ())


def test_warmup_curve_buckets_the_stream_and_divides_by_plain():
    rows = []
    for i in range(120):
        rows += [row(i, "plain", 50.0), row(i, "auto", 60.0), row(i, "auto+suffix", 50.0 + min(i, 100))]
    curve = rep.warmup_curve(rows)
    assert list(curve) == ["0", "10", "30", "100"]
    assert [curve[k]["requests"] for k in curve] == [10, 20, 70, 20]
    assert all(c["auto"] == 1.2 for c in curve.values())
    assert curve["0"]["auto+suffix"] < curve["10"]["auto+suffix"] < curve["30"]["auto+suffix"] < \
        curve["100"]["auto+suffix"] == 3.0
    report = rep.build_report(rows, command="edgespec bench", machine={}, settings={})
    assert report["warmup_curve"] == curve
    assert report["by_source"]["auto+suffix"]["suffix"] == {"proposed": 1200, "accepted": 840}
    md = rep.to_markdown(report)
    assert "## Warm-up curve" in md and "| 100 | 20 | 50.0 | 1.20 | 3.00 |" in md


def test_no_curve_without_a_suffix_mode():
    assert rep.warmup_curve([row(0, "plain", 50.0), row(0, "auto", 60.0)]) == {}


def test_the_repetitive_suite_is_a_stream_of_four_interleaved_kinds():
    prompts = load_suite("repetitive")
    assert len(prompts) == 120
    assert [p.category for p in prompts[:4]] == ["repetitive-extraction", "repetitive-sql", "repetitive-form",
                                                 "repetitive-agent"]


def test_serving_daemons_run_without_the_cache_unless_asked():
    from edgespec.bench.serve_systems import daemon_sections

    kw = dict(target="t.gguf", draft=None, parallel=4, n_ctx=1024, threads=2, max_tokens=64)
    assert daemon_sections(**kw)["speculation"]["suffix_cache"] is False
    assert daemon_sections(**kw, suffix_cache=True)["speculation"]["suffix_cache"] is True
