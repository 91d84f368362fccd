"""The cross-request suffix cache (edgespec/drafters/suffix.py): what it proposes, its memory
bound under a soak, isolation by caller, its snapshot; and through the engine tick on the fake
backend: greedy output identical to plain with the cache on, and at T > 0 the emitted tokens
distributed exactly as the target's (a chi-square test over the bigram target's transitions that
rejects a broken twin grafting the cache's tokens as if the draft had sampled them)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from edgespec.drafters import suffix as sfx
from edgespec.drafters.suffix import Proposal, SuffixCache, SuffixDrafter
from edgespec.sampling import SamplingParams, logits_to_probs
from edgespec.selftest import ALPHA, chi2_sf, chi_square_gof
from edgespec.tree import DraftTree
from edgespec.types import GenerationRequest, SpeculationParams
from tests.fake_backend import bigram_table, fake_backed_engine

TEMPLATE = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]


def reply(i: int) -> list[int]:
    """A templated reply: fixed structure, one varying field."""
    return [10, 11, 12, 100 + i % 7, 13, 14, 15, 16, 200 + i % 3, 17, 18]


# -- the cache ----------------------------------------------------------------------------------

def test_proposal_scores_are_the_share_of_matches_that_continued_so():
    c = SuffixCache(1 << 20)
    for i in range(10):
        c.insert("", TEMPLATE, reply(i))
    prop = c.propose("", TEMPLATE[-4:] + [10, 11, 12, 103, 13])  # after the varying field
    # one reply matches that long: its continuation, at 1/2 (one vote and the pseudo-vote)
    assert prop.tokens[:3] == [14, 15, 16] and prop.scores[:3] == [0.5, 0.5, 0.5] and prop.voters == 1
    # matched on 3 tokens only, every reply votes: the next field varies over 3 values
    prop = c.propose("", [77, 14, 15, 16])
    assert prop.match == 3 and prop.voters == 10
    first = sorted((prop.scores[i], prop.tokens[i]) for i, p in enumerate(prop.parents) if p < 0)
    assert first[-1] == (4 / 11, 200) and set(first[:-1]) <= {(3 / 11, 201), (3 / 11, 202)}
    assert len(prop) == int(sfx.NODES_PER_MATCH * 3)  # sized by the match length
    # best first: every node after its parent, learnt probabilities non-increasing (untrained:
    # the prior's 1/2 per node along a path), ties in order of votes
    assert all(p < i for i, p in enumerate(prop.parents))
    assert prop.probs == sorted(prop.probs, reverse=True)
    assert prop.probs[0] == pytest.approx(0.5) and prop.tokens[0] == 200
    for a, b in zip(range(len(prop)), range(1, len(prop))):
        assert prop.probs[a] > prop.probs[b] or prop.scores[a] >= prop.scores[b]


def test_the_reply_start_is_found_from_the_prompt_anchor():
    c = SuffixCache(1 << 20)
    c.insert("", [1, 2, 3] + TEMPLATE, reply(0))
    prop = c.propose("", [9, 9] + TEMPLATE)  # another prompt ending like the template
    assert prop.tokens[:3] == [10, 11, 12]
    assert c.propose("", [1, 2, 3]).tokens == []  # the prompt's head is not stored (store = output)


def test_callers_are_isolated_unless_pooled():
    c = SuffixCache(1 << 20)
    c.insert("token:alice", TEMPLATE, reply(0))
    assert c.propose("token:alice", TEMPLATE).tokens
    assert c.propose("token:bob", TEMPLATE).tokens == []
    assert c.propose("", TEMPLATE).tokens == []  # anonymous callers share their own partition
    pooled = SuffixCache(1 << 20, pooled=True)
    pooled.insert("token:alice", TEMPLATE, reply(0))
    assert pooled.propose("token:bob", TEMPLATE).tokens


def test_least_recently_used_documents_are_evicted_first():
    c = SuffixCache(int(SuffixCache()._doc_bytes(12) * 2.5))  # room for two documents of 12 tokens
    a, b, d = (list(range(k, k + 12)) for k in (1000, 2000, 3000))
    c.insert("", [], a)
    c.insert("", [], b)
    assert c.propose("", a[:5]).tokens  # a is used: b is now the least recently used
    c.insert("", [], d)
    assert c.propose("", a[:5]).tokens and c.propose("", d[:5]).tokens
    assert c.propose("", b[:5]).tokens == []
    assert c.evicted == 1


def test_soak_ten_thousand_insertions_stay_within_the_bound():
    """10,000 requests of random and templated replies under a 256 KiB bound: the accounted
    bytes never exceed it, and the index holds no key or occurrence of an evicted document."""
    bound = 256 << 10
    c = SuffixCache(bound)
    rng = np.random.default_rng(0)
    peak = 0
    for i in range(10_000):
        out = rng.integers(0, 5000, size=int(rng.integers(4, 120))).tolist() if i % 3 else reply(i)
        c.insert(f"token:{i % 5}", rng.integers(0, 5000, size=8).tolist(), out)
        peak = max(peak, c.bytes)
        assert c.bytes <= bound
    assert c.evicted > 0 and peak > bound * 0.8
    # the counters are what the structure holds
    keys = sum(len(p.index) for p in c._parts.values())
    occ = sum(len(o) for p in c._parts.values() for o in p.index.values())
    docs = sum(len(t) for _, t in c._docs.values())
    assert (keys, occ) == (c.keys, c.occurrences)
    assert c.bytes == len(c._docs) * sfx.DOC_BYTES + docs * sfx.TOKEN_BYTES + keys * sfx.KEY_BYTES + \
        occ * sfx.OCC_BYTES
    live = set(c._docs)
    assert all(o >> sfx.POS_BITS in live for p in c._parts.values() for v in p.index.values() for o in v)


def test_accounted_bytes_cover_what_python_allocates():
    rng = np.random.default_rng(1)
    replies = [rng.integers(0, 30000, size=100).tolist() for _ in range(200)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    c = SuffixCache(1 << 30)
    for i, out in enumerate(replies):
        c.insert(f"token:{i % 3}", [1, 2, 3], out)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert used <= c.bytes, (used, c.bytes)
    assert c.bytes <= 3 * used  # and not wildly above it


def test_snapshot_round_trip_and_checksum(tmp_path):
    c = SuffixCache(1 << 20)
    for i in range(5):
        c.insert("token:a", TEMPLATE, reply(i))
    path = tmp_path / "suffix.snapshot"
    c.save(path)
    d = SuffixCache(1 << 20)
    assert d.load(path) == 5
    assert d.propose("token:a", TEMPLATE).tokens == c.propose("token:a", TEMPLATE).tokens
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="checksum"):
        SuffixCache(1 << 20).load(path)
    with pytest.raises(ValueError, match="larger than"):
        SuffixCache(1 << 20).load(path, max_file_bytes=10)
    path.write_bytes(b"not a snapshot")
    with pytest.raises(ValueError, match="not a suffix cache snapshot"):
        SuffixCache(1 << 20).load(path)


class LinearCost:
    """Verification seconds 1 + step * (n - 1): each extra token costs `step`."""

    def __init__(self, step):
        self.step = step

    def verify_seconds(self, n):
        return 1.0 + self.step * (n - 1)

    def extra_seconds(self, base, k):
        return self.verify_seconds(base + k) - self.verify_seconds(base)


def test_budget_prices_nodes_on_the_marginal_verification_cost():
    prop = Proposal(tokens=[1, 2, 3, 4], parents=[-1, 0, 1, 2], scores=[0.5] * 4, probs=[1.0, 0.9, 0.2, 0.1], match=8)
    budget = SuffixDrafter.budget
    assert budget(prop, LinearCost(0.0), 1, 1.0) == 4  # free verification: all of it
    assert budget(prop, LinearCost(0.3), 1, 1.0) == 2  # 0.2 < 0.3: the third node does not pay
    assert budget(prop, LinearCost(2.0), 1, 1.0) == 0
    assert budget(prop, LinearCost(0.0), 1, 1.0, room=2) == 2
    assert SuffixDrafter.expected(prop, 2) == pytest.approx(1.9)


def emit_stream(cache, replies, prompt, caller=""):
    """Requests whose target emits `replies` one after the other: each step proposes from the
    cache, the target emits one token (the shadow evaluation then learns), the reply is stored."""
    for out in replies:
        d = SuffixDrafter(cache, caller)
        for pos in range(len(out)):
            d.look(prompt + out[:pos])
            d.score(prompt + out[:pos + 1])
        cache.insert(caller, prompt, out)


def test_acceptance_is_learnt_from_what_the_target_then_emitted():
    rng = np.random.default_rng(0)
    # a template whose one field is new in every reply (an invoice number): after the field the
    # template continues as every earlier reply did; at the field each earlier reply votes for
    # its own value, one voter each, and the target emits none of them
    replies = [[10, 11, 12, int(rng.integers(300, 900)), 13, 14, 15, 16, 17, 18, 19, 20, 21] for _ in range(40)]
    c = SuffixCache(1 << 20)
    emit_stream(c, replies, TEMPLATE)
    acc = c.acceptance("")
    template = c.propose("", TEMPLATE[-5:] + [10, 11, 12, 777, 13, 14, 15])  # after a new field value
    assert template.tokens[:6] == [16, 17, 18, 19, 20, 21]
    assert template.probs[0] > 0.9 and acc.p(template.features[0]) > 0.9
    field = c.propose("", TEMPLATE + [10, 11, 12])  # before the field
    assert field.voters > 1 and field.probs[0] < 0.2  # split votes that never came true
    # priced at 0.3 a token, the template's run is grafted and the field is not
    assert SuffixDrafter.budget(template, LinearCost(0.3), 1, 1.0) == 6
    assert SuffixDrafter.budget(field, LinearCost(0.3), 1, 1.0) == 0


def test_learning_is_per_partition():
    replies = [[10, 11, 12, 100 + i, 13, 14, 15, 16] for i in range(20)]
    c = SuffixCache(1 << 20)
    emit_stream(c, replies, TEMPLATE, caller="token:alice")
    c.insert("token:bob", TEMPLATE, replies[0])
    alice, bob = c.acceptance("token:alice"), c.acceptance("token:bob")
    assert not np.allclose(alice.accepted / alice.trials, sfx.PRIOR_ACCEPT / (sfx.PRIOR_ACCEPT + sfx.PRIOR_REJECT))
    assert np.allclose(bob.accepted / bob.trials, sfx.PRIOR_ACCEPT / (sfx.PRIOR_ACCEPT + sfx.PRIOR_REJECT))


def test_a_proposal_is_learnt_from_only_once_the_emitted_tokens_decide_it():
    prop = Proposal(tokens=[1, 2, 9], parents=[-1, 0, -1], scores=[0.5, 0.5, 0.3], probs=[0.5, 0.25, 0.3],
                    features=[0, 1, 2])
    assert sfx.trials(prop, []) is None  # nothing emitted yet
    assert sfx.trials(prop, [1]) is None  # on the path, its next node undecided
    assert sorted(sfx.trials(prop, [1, 2])) == [(0, True), (1, True), (2, False)]  # the deepest reached
    assert sorted(sfx.trials(prop, [1, 5])) == [(0, True), (1, False), (2, False)]
    assert sorted(sfx.trials(prop, [4])) == [(0, False), (2, False)]  # the children of a missed node: no trial


def test_forgetting_keeps_a_feature_recent():
    a = sfx.Acceptance()
    for _ in range(2000):
        a.update(3, True)
    assert a.p(3) > 0.99 and a.trials[3] < sfx.FORGET
    for _ in range(int(sfx.FORGET)):
        a.update(3, False)
    assert a.p(3) < 0.4  # the last FORGET trials outweigh the 2000 before them


def test_graft_follows_existing_children_and_adds_point_nodes():
    tree = DraftTree.root(5)
    tree.q[0] = np.full(64, 1 / 64)
    a = tree.add(0, 7, point=False)
    prop = Proposal(tokens=[7, 8, 9], parents=[-1, 0, -1], scores=[1.0, 0.8, 0.3])
    added = SuffixDrafter.graft(tree, prop, 3)
    tree.check()
    assert tree.parents[added[0]] == a and tree.tokens[added[0]] == 8 and tree.point[added[0]]
    assert tree.parents[added[1]] == 0 and tree.tokens[added[1]] == 9


# -- through the engine -------------------------------------------------------------------------

def stream(eng, prompts, mode, **kw):
    outs = []
    for p in prompts:
        r = eng.generate(GenerationRequest(tuple(p), SamplingParams(max_tokens=kw.get("max_tokens", 30)),
                                           SpeculationParams(mode=mode), caller=kw.get("caller", "")))
        outs.append(r)
    return outs


PROMPTS = [[0, 5, 9, 14], [0, 7, 7, 7, 21, 30], [0, 5, 9, 14], [0, 40, 41, 42], [0, 7, 7, 7, 21, 30]] * 2


@pytest.mark.parametrize("mode", ["auto", "chain", "tree"])
def test_greedy_output_with_the_cache_equals_plain(mode):
    ref = [r.token_ids for r in stream(fake_backed_engine(parallel=1), PROMPTS, "plain")]
    eng = fake_backed_engine(parallel=1)
    got = stream(eng, PROMPTS, mode)
    assert [r.token_ids for r in got] == ref
    assert sum(r.stats.accepted_by_source.get("suffix", 0) for r in got) > 0
    assert eng.suffix_stats()["documents"] == len(PROMPTS)


def test_batched_sessions_with_the_cache_equal_plain():
    ref = {tuple(p): r.token_ids for p, r in zip(PROMPTS, stream(fake_backed_engine(parallel=1), PROMPTS, "plain"))}
    eng = fake_backed_engine(parallel=3)
    stream(eng, PROMPTS[:3], "auto")  # warm the cache
    for batch in (PROMPTS[:3], PROMPTS[3:6]):
        sess = [eng.open_session(GenerationRequest(tuple(p), SamplingParams(max_tokens=30))) for p in batch]
        for s in sess:
            s.check_kv = True
        while any(not s.done for s in sess):
            eng.tick([s for s in sess if not s.done])
        for p, s in zip(batch, sess):
            assert list(s.out) == ref[tuple(p)]
            s.close()


def test_a_caller_never_drafts_from_another_callers_text():
    eng = fake_backed_engine(parallel=1)
    stream(eng, PROMPTS[:2], "auto", caller="token:alice")
    other = stream(eng, PROMPTS[:1], "auto", caller="token:bob")  # bob's first request: nothing of his yet
    assert "suffix" not in other[0].stats.proposed_by_source
    again = stream(eng, PROMPTS[:2], "auto", caller="token:alice")
    assert all(r.stats.accepted_by_source.get("suffix", 0) > 0 for r in again)


def test_plain_requests_neither_read_nor_feed_the_cache_and_off_empties_it():
    eng = fake_backed_engine(parallel=1)
    stream(eng, PROMPTS[:2], "plain")
    assert eng.suffix_stats()["documents"] == 0
    stream(eng, PROMPTS[:2], "auto")
    assert eng.suffix_stats()["documents"] == 2
    assert eng.suffix_control(clear=True)["documents"] == 0
    stream(eng, PROMPTS[:2], "auto")
    st = eng.suffix_control(enabled=False)
    assert st["documents"] == 0 and not st["enabled"]
    stream(eng, PROMPTS[:2], "auto")
    assert eng.suffix_stats()["documents"] == 0


# -- exactness at T > 0 -------------------------------------------------------------------------

SAMPLING = dict(temperature=1.0, top_k=8)
TRIALS = 160


SHAPES = {"tree": dict(mode="tree", tree_nodes=8, tree_depth=3), "chain": dict(mode="chain", draft_tokens=3)}


def transitions_p_value(eng_factory, shape: str, trials: int = TRIALS, seed: int = 0) -> tuple[float, int]:
    """Run a stream of sampled requests (the draft model's sampled children and the cache's
    point nodes in one tree) and test every emitted transition a -> b against the
    target's p(b | a): the fake target is a bigram model, so given the whole past each token is
    drawn from the row of the token before it. Pearson chi-square per row (small cells pooled),
    summed over rows. Returns (p value, suffix tokens accepted)."""
    eng = eng_factory()
    sp = SamplingParams(max_tokens=24, **SAMPLING)
    counts = np.zeros((64, 64))
    suffix_accepted = 0
    rng = np.random.default_rng(seed)
    prompts = [[0, 5, 9, 14], [0, 7, 21, 30], [0, 40, 41]]
    for i in range(trials):
        p = prompts[i % len(prompts)]
        r = eng.generate(GenerationRequest(tuple(p), SamplingParams(**{**sp.__dict__, "seed": int(rng.integers(1 << 62))}),
                                           SpeculationParams(**SHAPES[shape])))
        toks = list(p) + r.token_ids
        for a, b in zip(toks[len(p) - 1:-1], toks[len(p):]):
            counts[a, b] += 1
        suffix_accepted += r.stats.accepted_by_source.get("suffix", 0)
    table = eng.target.table
    stat, dof = 0.0, 0
    for a in np.flatnonzero(counts.sum(axis=1)):
        probs = logits_to_probs(table[a].astype(np.float64), sp)
        s, d, _ = chi_square_gof(counts[a], probs)
        if s == float("inf"):
            return 0.0, suffix_accepted
        stat, dof = stat + s, dof + d
    return chi2_sf(stat, dof), suffix_accepted


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_sampled_output_with_the_cache_is_distributed_as_the_targets(shape):
    p, accepted = transitions_p_value(lambda: fake_backed_engine(parallel=1, draft_noise=2.0), shape)
    assert accepted > 200  # the cache's tokens really were verified and accepted
    assert p > ALPHA, p


def test_grafting_the_caches_tokens_as_sampled_drafts_is_detected(monkeypatch):
    """The broken twin: the cache's tokens grafted as if the draft had sampled them from q
    (accepted with min(1, p/q) instead of p): the same test must reject it."""

    def as_sampled(tree, prop, k):
        at, added = [], []
        for i in range(k):
            parent = 0 if prop.parents[i] < 0 else at[prop.parents[i]]
            tok = prop.tokens[i]
            node = next((c for c in range(1, len(tree)) if tree.parents[c] == parent and tree.tokens[c] == tok), None)
            if node is None:
                q = tree.q[parent]
                node = tree.add(parent, tok, point=not (q is not None and q[tok] > 0))
                added.append(node)
            at.append(node)
        return added

    monkeypatch.setattr(SuffixDrafter, "graft", staticmethod(as_sampled))
    p, _ = transitions_p_value(lambda: fake_backed_engine(parallel=1, draft_noise=2.0), "chain", trials=3 * TRIALS)
    assert p < ALPHA, p


def test_bigram_rows_make_a_usable_test():
    """The fake target's top-8 rows are far from uniform (the test compares real distributions)."""
    probs = logits_to_probs(bigram_table()[5].astype(np.float64), SamplingParams(**SAMPLING))
    assert np.count_nonzero(probs) == 8 and probs.max() < 0.99


def test_the_daemon_loads_its_snapshot_and_starts_empty_on_a_bad_one(tmp_path, monkeypatch):
    from edgespec.drafters.suffix import snapshot_path
    from edgespec.server.daemon import _load_suffix, suffix_model

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    eng = fake_backed_engine(parallel=1)
    stream(eng, PROMPTS[:2], "auto", caller="token:a")
    eng.suffix_cache.save(snapshot_path(), model=suffix_model(eng))
    fresh = fake_backed_engine(parallel=1)
    _load_suffix(fresh)
    assert fresh.suffix_stats()["documents"] == 2
    assert fresh.suffix_cache.propose("token:a", list(PROMPTS[0]) + stream(eng, PROMPTS[:1], "plain")[0].token_ids[:4])
    snapshot_path().write_bytes(snapshot_path().read_bytes()[:-5])  # truncated
    fresh = fake_backed_engine(parallel=1)
    _load_suffix(fresh)
    assert fresh.suffix_stats()["documents"] == 0
    # a [[chat]] model's snapshot: a file of its own beside the default model's, by its name
    names = ("SmolLM2-135M-Instruct.Q8_0", "org/model:q8", "org_model_q8")
    paths = [snapshot_path(n) for n in names]
    assert len({*paths, snapshot_path()}) == 4 and all(p.parent == tmp_path and "/" not in p.name[6:] for p in paths)
    eng.suffix_cache.save(paths[1], model=suffix_model(eng))
    fresh = fake_backed_engine(parallel=1)
    _load_suffix(fresh, "org/model:q8")
    assert fresh.suffix_stats()["documents"] == 2
    _load_suffix(fresh := fake_backed_engine(parallel=1), "org_model_q8")  # a name like it: not its snapshot
    assert fresh.suffix_stats()["documents"] == 0


def test_a_daemons_drain_writes_the_snapshot_the_next_one_loads(tmp_path, monkeypatch):
    """speculation.suffix_cache_persist: a drain and a stop write the engine's suffix cache
    (LoopEngine.suffix_cache: no probe for it) into the state directory, on the engine thread."""
    from edgespec.drafters.suffix import snapshot_path
    from edgespec.server.config import load
    from edgespec.server.daemon import Daemon, _load_suffix

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    eng = fake_backed_engine(parallel=1)
    eng.warmup = lambda: None  # the cache holds what the stream below leaves, nothing more
    stream(eng, PROMPTS[:2], "auto", caller="token:a")
    cfg = load(None, env={}, overrides={"server": {"port": 0, "parallel": 1, "queue_size": 1},
                                        "speculation": {"suffix_cache_persist": True}})
    d = Daemon(cfg, engine_factory=lambda: eng)
    d.start()
    try:
        assert d.loop.wait_loaded(10)
        d._drain(True)
        assert snapshot_path().is_file()
        snapshot_path().unlink()
    finally:
        d.shutdown(grace=0.5)
    assert snapshot_path().is_file()  # the stop writes it too
    fresh = fake_backed_engine(parallel=1)
    _load_suffix(fresh)
    assert fresh.suffix_stats()["documents"] == 2


@pytest.mark.slow
def test_real_models_greedy_output_with_the_cache_equals_plain(engine, monkeypatch):
    """The demo models on a small templated stream: auto with the suffix cache emits plain's
    tokens, and the cache's drafts are accepted (the templates repeat)."""
    # the goodput guard's bare plain ticks (exploration, or a fallback earlier tests on this shared
    # engine measured) graft nothing: this test is about the cache
    monkeypatch.setattr(engine.goodput, "enabled", False)
    engine.suffix_control(enabled=True, clear=True)  # the shared fixture runs without it
    prompts = [engine.encode_chat([("user", f"Return JSON with keys id and city for: id {i}, city Berlin.")])
               for i in (7, 8, 9)]
    try:
        plain = [engine.generate(GenerationRequest(tuple(p), SamplingParams(max_tokens=24),
                                                   SpeculationParams(mode="plain"))).token_ids for p in prompts]
        got = [engine.generate(GenerationRequest(tuple(p), SamplingParams(max_tokens=24),
                                                 SpeculationParams(mode="auto"), caller="token:t")) for p in prompts]
        assert [r.token_ids for r in got] == plain
        assert sum(r.stats.accepted_by_source.get("suffix", 0) for r in got[1:]) > 0
    finally:
        engine.suffix_control(enabled=False, clear=True)


def test_a_snapshot_of_another_model_or_vocabulary_is_discarded_with_a_log_line(tmp_path, monkeypatch):
    """A snapshot records the model whose token ids it holds: after a model change it is stale
    (discarded, logged), and ids outside the vocabulary are refused before anything is inserted
    (they failed the tick of every request a draft of theirs joined)."""
    from structlog.testing import capture_logs

    from edgespec.drafters.suffix import snapshot_path
    from edgespec.server.daemon import _load_suffix, suffix_model

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    eng = fake_backed_engine(parallel=1)
    stream(eng, PROMPTS[:2], "auto", caller="token:a")
    eng.suffix_cache.save(snapshot_path(), model="another-target.gguf:123:32000")
    fresh = fake_backed_engine(parallel=1)
    with capture_logs() as logs:
        _load_suffix(fresh)
    assert fresh.suffix_stats()["documents"] == 0
    assert any(e["event"] == "suffix_cache_load_failed" and "stale" in e["error"] for e in logs), logs
    c = SuffixCache(1 << 20)
    c.insert("token:a", TEMPLATE, [1, 2, fresh.target.n_vocab + 5])
    c.save(snapshot_path(), model=suffix_model(fresh))
    with capture_logs() as logs:
        _load_suffix(fresh)
    assert fresh.suffix_stats()["documents"] == 0
    assert any(e["event"] == "suffix_cache_load_failed" and "outside the vocabulary" in e["error"] for e in logs)
