"""The two probes of the benchmark page (`python -m edgespec.bench.ttft_probe`,
`... deadline_probe`): the prompt they send is the size they report, each round's text is new
(no cache can help), and against a real daemon on the demo target the time to first token and
the deadline's status are what they read."""

from __future__ import annotations

import math

import pytest

from edgespec.bench.deadline_probe import trials
from edgespec.bench.serve_systems import daemon_sections, start_daemon
from edgespec.bench.ttft_probe import context, ttft_edgespec


def test_each_rounds_context_is_new_text_of_the_asked_length():
    a, b = context(560, 0), context(560, 1)
    assert a != b and a.split("\n", 1)[1][:200] != b.split("\n", 1)[1][:200]
    assert a.endswith("Answer briefly.") and abs(len(context(2800, 0)) - 5 * len(a)) < 0.05 * 5 * len(a)


@pytest.mark.slow
def test_the_probes_read_a_real_daemon(demo_pair, tmp_path):
    p = start_daemon(tmp_path, daemon_sections(target=str(demo_pair.target), draft=None, parallel=1, n_ctx=4096,
                                               threads=1, max_tokens=8))
    try:
        seconds, prompt_tokens = ttft_edgespec(p.addr, context(560, 0), 4)
        assert seconds > 0 and 0.75 * 560 < prompt_tokens < 1.25 * 560, prompt_tokens  # CHARS_PER_TOKEN holds
        [(status, gap)] = trials(p.addr, 1, 0.2)
    finally:
        p.stop()
    assert status == "DEADLINE_EXCEEDED" and math.isfinite(gap)
