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


def reference_probs(logits, s):
    """The transform as first written: a full stable sort of the candidates, the slow reference."""
    x = np.asarray(logits, dtype=np.float64) / s.temperature
    n = len(x)
    keep = None
    if 0 < s.top_k < n:
        keep = np.argpartition(-x, s.top_k - 1)[: s.top_k]
    if s.top_p < 1.0 or s.min_p > 0.0:
        cand = keep if keep is not None else np.arange(n)
        cand = cand[np.argsort(-x[cand], kind="stable")]
        pc = np.exp(x[cand] - x[cand[0]])
        pc /= pc.sum()
        m = len(cand)
        if s.min_p > 0.0:
            m = min(m, int(np.count_nonzero(pc >= s.min_p * pc[0])))
        if s.top_p < 1.0:
            m = min(m, int(np.searchsorted(np.cumsum(pc), s.top_p, side="left")) + 1)
        keep = cand[: max(m, 1)]
    if keep is None:
        return softmax(x)
    out = np.zeros(n)
    out[keep] = softmax(x[keep])
    return out


@pytest.mark.parametrize("shape", ["peaked", "flat", "ties", "one-hot"])
def test_nucleus_head_matches_a_full_sort(shape):
    """top_p / min_p sort only the distribution's head (64 tokens, then 4x more while the cut lies
    beyond it): same kept set, same probabilities as a full sort, on peaked logits (the cut in the
    first head), flat ones (the head grows to the whole vocabulary), logits with many ties at the
    cut (lower token id first), and one token holding nearly all the mass."""
    rng = np.random.default_rng(7)
    vocab = 49152
    for trial in range(12):
        if shape == "peaked":
            x = rng.standard_normal(vocab) * 4.0
        elif shape == "flat":
            x = rng.standard_normal(vocab) * 0.05
        elif shape == "ties":
            x = np.round(rng.standard_normal(vocab) * 2.0) + 5.0 * (rng.random(vocab) < 0.001)
        else:
            x = rng.standard_normal(vocab)
            x[rng.integers(vocab)] = 60.0
        for top_p, min_p, top_k in ((0.95, 0.0, 0), (0.5, 0.0, 0), (0.999, 0.0, 0), (1.0, 0.05, 0), (1.0, 1e-5, 0),
                                    (1.0, 0.001, 0), (0.9, 0.1, 0), (0.9, 0.0, 500), (0.99, 0.02, 50)):
            s = SamplingParams(temperature=[0.7, 1.0, 1.3][trial % 3], top_p=top_p, min_p=min_p, top_k=top_k)
            got, want = logits_to_probs(x, s), reference_probs(x, s)
            assert np.array_equal(np.flatnonzero(got), np.flatnonzero(want)), (shape, trial, s)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


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
        s.temperature = 1.0
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


def test_sample_walks_the_support_only_and_draws_what_the_full_cdf_draws():
    """For the same uniform, the support's CDF picks the token the whole vector's CDF picks
    (zeros add nothing to a running sum): seeded draws are unchanged by skipping the zeros."""
    def full_cdf(probs, rng):
        c = np.cumsum(probs)
        return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), len(probs) - 1))

    gen = np.random.default_rng(5)
    for trial in range(50):
        probs = np.zeros(49152)
        support = gen.choice(49152, size=int(gen.integers(1, 300)), replace=False)
        probs[support] = gen.dirichlet(np.ones(len(support)) * 0.3)
        a, b = np.random.default_rng(trial), np.random.default_rng(trial)
        assert [sample(probs, a) for _ in range(20)] == [full_cdf(probs, b) for _ in range(20)]


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


def test_one_check_names_the_field_as_each_api_does():
    """gRPC (sampling.), HTTP (bare) and the CLI (SamplingParams) share check_sampling."""
    from edgespec.sampling import check_sampling

    for prefix in ("", "sampling."):
        with pytest.raises(BadRequest) as e:
            check_sampling({"top_p": 0.0}, prefix=prefix)
        assert e.value.field == prefix + "top_p" and "(0, 1]" in str(e.value)
        with pytest.raises(BadRequest) as e:
            check_sampling({"max_tokens": 300}, prefix=prefix, max_tokens_limit=256)
        assert e.value.field == prefix + "max_tokens" and "[1, 256]" in str(e.value)
        with pytest.raises(BadRequest) as e:
            check_sampling({"stop": ("ab", "abcd")}, prefix=prefix, max_stop_chars=3)
        assert e.value.field == prefix + "stop[1]" and "limits.max_stop_chars" in str(e.value)
    check_sampling({"temperature": None, "seed": None, "max_tokens": 256}, max_tokens_limit=256)  # None = unset
