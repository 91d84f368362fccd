"""Sampling transforms with known answers, validation naming the field, seeded draws."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgespec.errors import BadRequest
from edgespec.sampling import MAX_STOP_STRINGS, SamplingParams, logits_to_probs, sample

LOGITS = np.log(np.array([0.1, 0.4, 0.2, 0.3]))  # softmax at T=1 is exactly these


def softmax(x):
    z = np.exp(x - np.max(x))
    return z / z.sum()


def test_temperature_one_is_softmax():
    p = logits_to_probs(LOGITS, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(p, [0.1, 0.4, 0.2, 0.3])
    assert p.dtype == np.float64


def test_temperature_scales_logits():
    p = logits_to_probs(LOGITS, SamplingParams(temperature=0.5))
    want = np.array([0.1, 0.4, 0.2, 0.3]) ** 2
    np.testing.assert_allclose(p, want / want.sum())
    hot = logits_to_probs(LOGITS, SamplingParams(temperature=100.0))
    np.testing.assert_allclose(hot, 0.25, atol=0.01)


def test_greedy_is_one_hot_argmax():
    s = SamplingParams(temperature=0.0, top_k=3, top_p=0.5)
    assert s.greedy
    np.testing.assert_array_equal(logits_to_probs(LOGITS, s), [0, 1, 0, 0])
    np.testing.assert_array_equal(logits_to_probs(np.array([5.0, -1.0, 9.0]), SamplingParams()), [0, 0, 1])


def test_top_k():
    p = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0, 0.4 / 0.7, 0, 0.3 / 0.7])
    # top_k >= vocab is off
    np.testing.assert_allclose(logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_k=4)), [0.1, 0.4, 0.2, 0.3])
    np.testing.assert_allclose(logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_k=1)), [0, 1, 0, 0])


def test_top_p_smallest_prefix_reaching_mass():
    # sorted: 0.4, 0.3, 0.2, 0.1 -> cumulative 0.4, 0.7, 0.9, 1.0
    p = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.65))
    np.testing.assert_allclose(p, [0, 0.4 / 0.7, 0, 0.3 / 0.7])
    p = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.75))
    np.testing.assert_allclose(p, [0, 0.4 / 0.9, 0.2 / 0.9, 0.3 / 0.9])
    p = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))  # keeps at least one
    np.testing.assert_allclose(p, [0, 1, 0, 0])


def test_min_p_relative_to_top():
    # keep p >= 0.6 * 0.4 = 0.24: tokens 1 (0.4) and 3 (0.3)
    p = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.6))
    np.testing.assert_allclose(p, [0, 0.4 / 0.7, 0, 0.3 / 0.7])
    p = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.5))  # 0.2 >= 0.2 kept
    np.testing.assert_allclose(p, [0, 0.4 / 0.9, 0.2 / 0.9, 0.3 / 0.9])


def test_truncations_compose():
    # top_k=3 keeps {1,3,2}; top_p=0.75 over their renormalised masses (0.444, 0.333, 0.222) keeps {1,3}
    p = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_k=3, top_p=0.75))
    np.testing.assert_allclose(p, [0, 0.4 / 0.7, 0, 0.3 / 0.7])
    p = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_k=3, min_p=0.9))
    np.testing.assert_allclose(p, [0, 1, 0, 0])


def test_large_logits_are_stable():
    x = np.array([1000.0, 999.0, -1000.0])
    p = logits_to_probs(x, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(p, softmax(x))
    assert np.isfinite(p).all()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", 101.0),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 1.0),
        ("min_p", -0.1),
        ("seed", -1),
        ("seed", 2**63),
        ("max_tokens", 0),
        ("stop", tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1))),
    ],
)
def test_validation_names_the_field(field, value):
    with pytest.raises(BadRequest) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}:")


def test_empty_stop_string_names_its_index():
    with pytest.raises(BadRequest) as e:
        SamplingParams(stop=("ok", ""))
    assert e.value.field == "stop[1]"


def test_params_are_frozen():
    s = SamplingParams(temperature=0.7, seed=3, stop=("\n",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.temperature = 1.0  # type: ignore[misc]
    assert not s.greedy


def test_sample_never_returns_zero_probability_token():
    rng = np.random.default_rng(0)
    probs = np.array([0.0, 0.5, 0.0, 0.0, 0.5, 0.0])
    draws = {sample(probs, rng) for _ in range(5000)}
    assert draws == {1, 4}
    one = np.array([0.0, 0.0, 1.0, 0.0])
    assert {sample(one, rng) for _ in range(100)} == {2}
    # unnormalised input is scaled by its total, trailing zeros never chosen
    assert {sample(np.array([2.0, 0.0, 0.0]), rng) for _ in range(100)} == {0}


def test_sample_frequencies_match():
    rng = np.random.default_rng(1)
    probs = np.array([0.1, 0.4, 0.2, 0.3])
    n = 40_000
    counts = np.bincount([sample(probs, rng) for _ in range(n)], minlength=4)
    np.testing.assert_allclose(counts / n, probs, atol=0.01)


def test_sample_is_reproducible_with_a_seed():
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=0.9, seed=123))
    r1, r2, other = np.random.default_rng(123), np.random.default_rng(123), np.random.default_rng(124)
    s1 = [sample(probs, r1) for _ in range(200)]
    s2 = [sample(probs, r2) for _ in range(200)]
    s3 = [sample(probs, other) for _ in range(200)]
    assert s1 == s2
    assert s1 != s3
