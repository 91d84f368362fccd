"""The serving benchmark's maths on constructed traces with known answers."""

import pytest

from edgespec.bench.serve_stats import (
    Trace,
    cell_metrics,
    delivery_gaps,
    itl,
    percentile,
    ratio,
    request_metrics,
    speculation_summary,
    token_times,
    window_gaps,
    window_metrics,
)


def trace(submitted, arrivals, **kw):
    return Trace(system="s", prompt_id="p", submitted=submitted, arrivals=list(arrivals), **kw)


def test_a_chunk_of_k_tokens_arrives_k_times_at_once():
    assert token_times([(1.0, 1), (1.5, 3), (2.0, 1)]) == [1.0, 1.5, 1.5, 1.5, 2.0]
    assert itl([1.0, 1.5, 1.5, 1.5, 2.0]) == [0.5, 0.0, 0.0, 0.5]


def test_chunked_and_per_token_streams_of_the_same_arrivals_agree():
    # edgespec: one chunk of 3 tokens; llama-server: 3 events microseconds apart
    one = token_times([(0.0, 1), (0.3, 3)])
    three = token_times([(0.0, 1), (0.3, 1), (0.3000001, 1), (0.3000002, 1)])
    assert percentile(itl(one), 50) == pytest.approx(percentile(itl(three), 50), abs=1e-6)
    assert delivery_gaps(one) == pytest.approx([0.3])
    assert delivery_gaps(three) == pytest.approx([0.3])


def test_percentile_interpolates_and_handles_empty():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(range(101), 99) == pytest.approx(99.0)
    assert percentile([0.0, 1.0], 99) == pytest.approx(0.99)


def test_request_metrics():
    m = request_metrics(trace(10.0, [(10.5, 1), (10.7, 2), (11.5, 1)]))
    assert m["tokens"] == 4
    assert m["ttft_s"] == pytest.approx(0.5)
    assert m["latency_s"] == pytest.approx(1.5)
    assert m["tpot_s"] == pytest.approx(1.0 / 3)  # (11.5 - 10.5) / 3 gaps
    assert m["tokens_per_second"] == pytest.approx(3.0)


def test_server_count_wins_over_chunk_count():
    assert trace(0, [(1, 2)], completion_tokens=5).tokens == 5
    assert trace(0, [(1, 2), (2, 1)]).tokens == 3


def test_a_request_without_tokens():
    m = request_metrics(trace(0.0, [], error="UNAVAILABLE: x"))
    assert m["ttft_s"] is None and m["tokens"] == 0


def test_cell_metrics_aggregate_and_pool():
    a = trace(0.0, [(1.0, 1), (2.0, 1), (3.0, 1)])  # ttft 1, itl 1, 1
    b = trace(0.0, [(0.5, 2), (1.0, 1)])  # ttft 0.5, itl 0, 0.5
    bad = trace(0.0, [], error="boom")
    c = cell_metrics([a, b, bad], wall_seconds=3.0)
    assert c["requests"] == 3 and c["errors"] == 1
    assert c["completion_tokens"] == 6
    assert c["tokens_per_second"] == pytest.approx(2.0)
    assert c["ttft_p50_s"] == pytest.approx(0.75)
    assert c["itl_p50_s"] == pytest.approx(0.75)  # pooled [1, 1, 0, 0.5]
    assert c["tpot_mean_s"] == pytest.approx(2.5 / 4)
    assert c["delivery_gap_p50_s"] == pytest.approx(1.0)  # [1, 1, 0.5]: the 0 is no delivery
    assert c["request_tokens_per_second_p50"] == pytest.approx((1.0 + 4.0) / 2)  # 2/2 s and 2/0.5 s


def test_speculation_summary_is_token_weighted():
    a = trace(0, [(1, 8)], completion_tokens=8, speculation={"target_forwards": 2, "drafted_tokens": 8,
                                                              "accepted_tokens": 6})
    b = trace(0, [(1, 2)], completion_tokens=2, speculation={"target_forwards": 2, "drafted_tokens": 2,
                                                              "accepted_tokens": 0})
    s = speculation_summary([a, b])
    assert s["tau"] == pytest.approx(10 / 4)  # not the mean of 4 and 1
    assert s["acceptance"] == pytest.approx(0.6)
    assert speculation_summary([trace(0, [(1, 1)])]) == {}


def test_window_counts_a_stall_across_it_once_whole():
    stream = trace(0.0, [(0.9, 1), (1.0, 1), (4.0, 1), (4.1, 1)])  # a 3 s stall over the window [1.5, 3.5]
    assert window_gaps([stream], 1.5, 3.5) == [3.0]
    # gaps ending before the window or starting after it are left out
    assert window_gaps([stream], 4.05, 5.0) == pytest.approx([0.1])
    # a chunk of 3 tokens is one delivery: no zero gaps inside the window
    chunked = trace(0.0, [(0.9, 1), (2.0, 3), (2.5, 1)])
    assert window_gaps([chunked], 1.0, 3.0) == pytest.approx([1.1, 0.5])


def test_window_metrics():
    s1 = trace(0.0, [(0.5, 1), (1.0, 1), (1.1, 1), (3.0, 1), (3.1, 1)])
    s2 = trace(0.0, [(0.6, 1), (1.05, 1), (2.5, 1)])  # ends inside the window
    long = trace(1.05, [(2.9, 1), (3.0, 1)], prompt_tokens=2000)
    w = window_metrics([s1, s2], long)
    assert w["long_ttft_s"] == pytest.approx(1.85)
    assert w["window_gaps"] == 3  # s1: 1.1 -> 3.0 (and 1.0 -> 1.1), s2: 1.05 -> 2.5
    assert w["window_itl_max_s"] == pytest.approx(1.9)
    assert w["streams_decoding_throughout"] == 1
    assert w["before_itl_p50_s"] == pytest.approx(0.475)  # gaps before 1.05: s1 0.5, s2 0.45
    assert window_metrics([s1], trace(1.0, [], error="x"))["error"] == "x"


def test_ratio():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None
