"""logit_bias and the presence / frequency penalties under speculation (edgespec/penalties.py).

Each tree node's row is adjusted by the request's output plus that node's own path, so greedy
speculation emits plain decoding's tokens and sampling keeps plain decoding's distribution.

- Pure: a tree's adjusted rows equal, bit for bit, the rows plain decoding would adjust at each
  node (the output extended by the node's path); bad logit_bias entries are refused by name.
- Greedy, fake backend: chain and tree equal plain with strong penalties and a bias.
- Sampling, fake backend, with power: the first three tokens of tree sessions at temperature 1,
  top_k 3 (27 cells) against the exact joint distribution under the adjustment (Pearson
  chi-square at alpha 1e-3, as in tests/tick/test_sampling_exact.py; with 26 degrees of freedom
  a noncentrality of 58 gives power 0.97 (test_stated_power), so 2,500 samples a prompt reject any alternative at TV
  >= sqrt(58 / 10000) ~ 0.076). A broken twin that adjusts every node by the committed output
  only (not its path) is rejected.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edgespec.errors import BadRequest
from edgespec.penalties import Adjuster
from edgespec.sampling import SamplingParams, logits_to_probs
from edgespec.selftest import ALPHA, chi_square_gof
from edgespec.tree import DraftTree
from edgespec.types import GenerationRequest, SpeculationParams
from tests.fake_backend import EOS, VOCAB, bigram_table, fake_backed_engine

SAMPLES = 2500
PROMPTS = ((0, 5, 9), (0, 7, 21))
BOOSTED = 46  # a token the bias makes likely after anything: its repeat is what the penalty moves
TOKENS, TOP_K = 3, 3  # the first three tokens (the third is the first a depth-1 row can draw after
# a drafted first-level token: the first comes from the prompt's step), 27 cells
ADJUST = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={BOOSTED: 4.0, 3: -100.0})


def _random_tree(rng, n_nodes: int) -> DraftTree:
    tree = DraftTree.root(int(rng.integers(VOCAB)))
    for _ in range(n_nodes - 1):
        tree.add(int(rng.integers(len(tree))), int(rng.integers(8)), point=True)  # few ids: repeats
    return tree


def test_each_node_is_adjusted_as_plain_decoding_would_adjust_it():
    rng = np.random.default_rng(0)
    s = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3, repetition_penalty=1.7,
                       logit_bias={2: 1.25, 5: -3.0})
    for _ in range(20):
        tree = _random_tree(rng, 12)
        output = [int(t) for t in rng.integers(8, size=int(rng.integers(0, 6)))]
        prompt = [int(t) for t in rng.integers(16, size=4)]
        adj = Adjuster(s, VOCAB, prompt)
        rows = rng.normal(size=(len(tree), VOCAB)).astype(np.float32)
        got = adj.rows(rows, tree, output)
        assert np.array_equal(adj.rows(rows.copy(), tree, output, inplace=True), got)
        for i in range(len(tree)):
            path, j = [], i
            while j > 0:
                path.append(tree.tokens[j])
                j = tree.parents[j]
            plain = adj.rows(rows[i:i + 1], DraftTree.root(tree.tokens[i]), output + path[::-1])
            assert np.array_equal(got[i], plain[0]), i
            assert np.array_equal(got[i], adj.row(rows[i], output + path[::-1]))  # the drafts' view


def test_an_adjusted_row_follows_openais_definition():
    s = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: 2.0})
    row = np.zeros((1, VOCAB), np.float32)
    out = Adjuster(s, VOCAB).rows(row, DraftTree.root(0), [4, 4, 4, 9])[0]
    assert out[7] == 2.0 and out[4] == -(0.5 + 3 * 0.25) and out[9] == -(0.5 + 0.25) and out[5] == 0.0
    rep = Adjuster(SamplingParams(repetition_penalty=2.0), VOCAB, prompt=[0])
    row = np.array([[3.0, -3.0, 3.0, -3.0] + [1.0] * (VOCAB - 4)], np.float32)
    out = rep.rows(row, DraftTree.root(0), [1])[0]  # 0 in the prompt, 1 in the output
    assert list(out[:4]) == [1.5, -6.0, 3.0, -3.0]


@pytest.mark.parametrize(("value", "field"), [
    ({"x": 1.0}, "logit_bias.x"),
    ({"-3": 1.0}, "logit_bias.-3"),
    ({"5": 101.0}, "logit_bias.5"),
    ({"5": float("nan")}, "logit_bias.5"),
    ({"5": True}, "logit_bias.5"),
    ({str(i): 1.0 for i in range(1025)}, "logit_bias"),
    ("5", "logit_bias"),
])
def test_bad_logit_bias_is_refused_by_name(value, field):
    with pytest.raises(BadRequest) as e:
        SamplingParams(logit_bias=value)
    assert e.value.field == field


def test_a_bias_outside_the_vocabulary_is_refused_by_the_engine():
    eng = fake_backed_engine(parallel=1)
    with pytest.raises(BadRequest) as e:
        eng.open_session(GenerationRequest((0, 5), SamplingParams(logit_bias={VOCAB: 1.0})))
    assert e.value.field == f"logit_bias.{VOCAB}"


def test_ignore_eos_bans_the_end_of_generation_tokens_in_every_row():
    rng = np.random.default_rng(1)
    tree = _random_tree(rng, 6)
    rows = rng.normal(size=(len(tree), VOCAB)).astype(np.float32)
    rows[:, EOS] = 50.0  # every row would end the answer
    adj = Adjuster(SamplingParams(ignore_eos=True, logit_bias={EOS: 10.0, 7: 1.0}), VOCAB, eog=(EOS,))
    got = adj.rows(rows, tree, [])
    assert np.all(got[:, EOS] == -np.inf)
    assert np.array_equal(got[:, 7], rows[:, 7] + np.float32(1.0))
    others = [j for j in range(VOCAB) if j not in (EOS, 7)]
    assert np.array_equal(got[:, others], rows[:, others])
    # without ignore_eos the model's EOS list is not read
    assert Adjuster(SamplingParams(logit_bias={7: 1.0}), VOCAB, eog=(EOS,)).rows(rows, tree, [])[0, EOS] == 50.0


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_speculation_with_ignore_eos_equals_plain(mode):
    eng = fake_backed_engine(parallel=2, draft_noise=0.5)
    ends = SamplingParams(max_tokens=40, logit_bias={EOS: 9.0})  # greedy ends at EOS after 2 tokens
    s = SamplingParams(max_tokens=40, logit_bias={EOS: 9.0}, ignore_eos=True)
    for prompt in ((0, 5, 9), (0, 12, 30)):
        ended = eng.generate(GenerationRequest(prompt, ends, SpeculationParams(mode="plain")))
        assert ended.finish_reason == "eos" and len(ended.token_ids) < 40
        plain = eng.generate(GenerationRequest(prompt, s, SpeculationParams(mode="plain")))
        assert plain.finish_reason == "length" and len(plain.token_ids) == 40 and EOS not in plain.token_ids
        assert plain.token_ids[:len(ended.token_ids)] == ended.token_ids
        spec = eng.generate(GenerationRequest(prompt, s, SpeculationParams(mode=mode)))
        assert spec.token_ids == plain.token_ids and spec.finish_reason == "length"
        assert spec.stats.accepted_tokens > 0  # the drafts were verified, not skipped


def test_sampling_with_ignore_eos_never_ends_early():
    eng = fake_backed_engine(parallel=2, draft_noise=0.5)
    for seed in range(8):
        s = SamplingParams(max_tokens=30, temperature=1.0, seed=seed, logit_bias={EOS: 4.0}, ignore_eos=True)
        r = eng.generate(GenerationRequest(PROMPTS[seed % 2], s, SpeculationParams(mode="tree")))
        assert r.finish_reason == "length" and len(r.token_ids) == 30 and EOS not in r.token_ids


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_speculation_with_penalties_equals_plain(mode):
    eng = fake_backed_engine(parallel=2, draft_noise=0.5)
    s = SamplingParams(max_tokens=40, presence_penalty=1.0, frequency_penalty=0.8, repetition_penalty=1.4,
                       logit_bias={BOOSTED: 3.0})
    for prompt in PROMPTS:
        plain = eng.generate(GenerationRequest(prompt, s, SpeculationParams(mode="plain"))).token_ids
        spec = eng.generate(GenerationRequest(prompt, s, SpeculationParams(mode=mode)))
        assert spec.token_ids == plain
        assert spec.stats.accepted_tokens > 0  # the drafts were verified, not skipped
    # and the adjustment changes the text (else the test would prove nothing)
    free = eng.generate(GenerationRequest(PROMPTS[0], SamplingParams(max_tokens=40),
                                          SpeculationParams(mode="plain"))).token_ids
    assert free != eng.generate(GenerationRequest(PROMPTS[0], s, SpeculationParams(mode="plain"))).token_ids


def _probs(logits: np.ndarray, counts: dict, seen: set) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    r = ADJUST["repetition_penalty"]
    for t in seen:
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, b in ADJUST["logit_bias"].items():
        x[t] += b
    for t, c in counts.items():
        x[t] -= ADJUST["frequency_penalty"] * c + ADJUST["presence_penalty"]
    return logits_to_probs(x, SamplingParams(temperature=1.0, top_k=TOP_K))


def exact_joint(prompt) -> dict:
    """The first TOKENS tokens' joint distribution (an end-of-generation token ends the key)."""
    table = bigram_table()
    out: dict = {}

    def walk(prev: int, emitted: tuple, p: float) -> None:
        if len(emitted) == TOKENS:
            out[emitted] = out.get(emitted, 0.0) + p
            return
        counts: dict = {}
        for t in emitted:
            counts[t] = counts.get(t, 0) + 1
        q = _probs(table[prev], counts, set(prompt) | set(emitted))
        for t in np.flatnonzero(q):
            if t == EOS:
                out[emitted] = out.get(emitted, 0.0) + p * q[t]
            else:
                walk(int(t), emitted + (int(t),), p * q[t])

    walk(prompt[-1], (), 1.0)
    return out


def sample(n_each: int) -> list[dict]:
    eng = fake_backed_engine(parallel=8, draft_noise=1.0)
    counts: list[dict[Any, int]] = [{} for _ in PROMPTS]
    todo = [(j, i) for i in range(n_each) for j in range(len(PROMPTS))]
    active: dict = {}
    while todo or active:
        while todo and eng.free_slots:
            j, seed = todo.pop()
            s = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=TOKENS, seed=seed, **ADJUST)
            req = GenerationRequest(PROMPTS[j], s, SpeculationParams(mode="tree", tree_depth=2, tree_nodes=6))
            active[eng.open_session(req)] = j
        eng.tick(list(active))
        for sess, j in list(active.items()):
            if sess.done:
                k = tuple(sess.out[:TOKENS])
                counts[j][k] = counts[j].get(k, 0) + 1
                sess.close()
                del active[sess]
    return counts


def p_values(counts: list[dict]) -> list[float]:
    out = []
    for c, prompt in zip(counts, PROMPTS):
        exact = exact_joint(prompt)
        keys = sorted(set(exact) | set(c))
        out.append(chi_square_gof(np.array([c.get(k, 0) for k in keys]),
                                  np.array([exact.get(k, 0.0) for k in keys]))[2])
    return out


def test_tree_sampling_with_penalties_matches_the_adjusted_target():
    counts = sample(SAMPLES)
    # the boosted token's repeat is where the penalty bites: it must be common enough to matter
    assert sum(v for k, v in counts[0].items() if k[:1] == (BOOSTED,)) > SAMPLES // 10
    assert min(p_values(counts)) > ALPHA, counts


def test_adjusting_nodes_by_the_committed_output_only_is_rejected(monkeypatch):
    """The broken twin: every node's row adjusted as the root's (its path ignored)."""
    real = Adjuster.rows

    def rootish(self, rows, tree, output, inplace=False):
        root = DraftTree.root(tree.tokens[0])
        return np.concatenate([real(self, rows[i:i + 1], root, output) for i in range(len(rows))])

    monkeypatch.setattr(Adjuster, "rows", rootish)
    assert min(p_values(sample(SAMPLES))) < ALPHA


def test_stated_power():
    stats = pytest.importorskip("scipy.stats")
    crit = stats.chi2.ppf(1 - ALPHA, TOP_K ** TOKENS - 1)
    assert stats.ncx2.sf(crit, TOP_K ** TOKENS - 1, 58.0) >= 0.95
