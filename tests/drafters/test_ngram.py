"""Prompt-lookup drafter: matches, multiple continuations as a tree, exactness of grafting."""

from __future__ import annotations

import numpy as np

from edgespec.drafters.ngram import NgramDrafter, ReachPriors, default_reach, lookup, lookup_all
from edgespec.sampling import SamplingParams
from edgespec.shape import PLAIN
from edgespec.tick import graft
from edgespec.tree import DraftTree


def test_lookup_longest_suffix_most_recent():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    assert lookup(toks, 2) == [5, 6]  # the most recent earlier "1 2 3" is followed by 5 6
    assert lookup([7, 8, 9], 4) == []
    assert lookup(toks, 0) == []


def test_lookup_all_distinct_first_tokens():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3, 5, 7, 1, 2, 3]
    assert lookup_all(toks, 2, branches=3) == [[5, 7], [4, 9]]


def test_graft_as_tree_and_merge_with_existing_children():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    tree = DraftTree.root(3)
    tree.q[0] = None
    first = tree.add(0, 5, point=True)  # a model proposal that the lookup shares
    NgramDrafter(max_tokens=3, branches=2).propose(tree, toks, PLAIN, SamplingParams(), np.random.default_rng(0))
    tree.check()
    kids = tree.children()
    assert [tree.tokens[c] for c in kids[0]] == [5, 4]  # 5 reused (not duplicated), 4 a new branch
    assert tree.child_tokens(first) == [6]


def test_graft_budget_prices_extra_verification_in_plain_tokens():
    """k lookup tokens are grafted when E[min(L, k)] beats the extra verification time counted in
    plain-decoding tokens: on a flat curve even a weak 1-token guess pays, on a steep one only
    a reliable long lookup does."""
    from types import SimpleNamespace

    from edgespec.controller.cost import CostModel
    from edgespec.drafters.ngram import NGRAM_MAX

    flat = CostModel.from_tables({1: 0.012, 2: 0.012, 4: 0.014, 8: 0.020, 16: 0.032}, {1: 0.005})
    steep = CostModel.from_tables({1: 0.012, 2: 0.021, 4: 0.028, 8: 0.036, 16: 0.044}, {1: 0.005})
    weak = [0.2] + [0.05] * (NGRAM_MAX - 1)
    strong = [0.9 ** (j + 1) for j in range(NGRAM_MAX)]

    def budget(cost, reach, base=1, context=0):
        ngram = NgramDrafter()
        ngram.reach = [reach, reach]
        return graft.budget(SimpleNamespace(cost=cost, ngram=ngram, n_past=context), base)

    assert budget(flat, weak) == 1
    assert budget(steep, weak) == 0
    assert budget(steep, strong) >= 4
    assert budget(flat, strong) == NGRAM_MAX
    # on top of a 5-token chain the marginal cost is what counts: on the steep curve a 6th token
    # costs 2 ms (1/6 of a plain token) where a 2nd costs 9 ms, so the weak guess now pays
    assert budget(steep, weak, base=5) == 1
    # at a long context every verified token costs more (attention reads the whole cache): the
    # weak guess that pays on the flat curve near the calibration context does not at 8000 tokens
    flat.ctx.one, flat.ctx.each = 2.0e-6, 0.8e-6
    assert budget(flat, weak, context=100) == 1 and budget(flat, weak, context=8000) == 0


def test_a_new_request_starts_from_what_recent_requests_lookups_achieved():
    """Lookups that keep missing teach the caller's pooled reach; the next request's drafter
    starts there and grafts nothing on a curve where the optimistic default would graft."""
    from types import SimpleNamespace

    from edgespec.controller.cost import CostModel

    cost = CostModel.from_tables({1: 0.020, 2: 0.024, 4: 0.032, 8: 0.048}, {1: 0.005})
    priors = ReachPriors()

    def budget(ngram):
        return graft.budget(SimpleNamespace(cost=cost, ngram=ngram, n_past=0), 1)

    assert budget(NgramDrafter(prior=priors.reach("alice"))) >= 1  # the default reach: 0.5
    toks = [1, 2, 3, 4, 1, 2, 3]  # "1 2 3" occurred before: a lookup of 4 ...
    for _ in range(100):  # ... which the target never takes, over many short requests
        ng = NgramDrafter(prior=priors.reach("alice"))
        assert ng.look(toks)[0] == [4, 1, 2, 3]
        ng.score(toks + [9])
    assert priors.reach("alice")[0][0] < 0.1
    assert budget(NgramDrafter(prior=priors.reach("alice"))) == 0
    # callers are isolated (acceptance is latency: a shared prior would leak how another's text
    # repeats itself), unless the daemon pools its caches
    assert priors.reach("bob") == default_reach()
    assert budget(NgramDrafter(prior=priors.reach("bob"))) >= 1
    # the engine keys them by the suffix cache's partition: pooled, every caller's requests start
    # from one reach
    from edgespec.sampling import SamplingParams
    from edgespec.types import GenerationRequest, SpeculationParams
    from tests.fake_backend import fake_backed_engine

    for scope, shared in (("pooled", True), ("caller", False)):
        eng = fake_backed_engine(parallel=1, suffix_cache_scope=scope)
        eng.lookup_priors.reach(eng.suffix_cache.partition_of("alice"))[0][0] = 0.1
        s = eng.open_session(GenerationRequest((0, 5, 9), SamplingParams(max_tokens=4),
                                               SpeculationParams(mode="auto"), caller="bob"))
        assert (s.ngram.reach[0][0] == 0.1) == shared, scope
        s.close()
    assert priors.flat()["lookup_prior_partitions"] == 2.0
    priors.clear()
    assert priors.reach("alice") == default_reach()


def test_reach_priors_hold_a_bounded_number_of_partitions():
    priors = ReachPriors(max_partitions=3)
    for c in ("a", "b", "c"):
        priors.reach(c)[0][0] = 0.1
    priors.reach("a")  # used: kept
    priors.reach("d")  # the least recently used ("b") leaves
    assert priors.flat()["lookup_prior_partitions"] == 3.0
    assert priors.reach("a")[0][0] == 0.1 and priors.reach("c")[0][0] == 0.1
    assert priors.reach("b") == default_reach()


def test_a_lookup_is_keyed_by_how_it_stands_to_the_suffix_cache():
    """A lookup's kind says how it matched and whether the suffix cache's proposal at that step
    agrees with its first token, contradicts it, or is absent; each kind learns its own reach,
    so lookups that keep contradicting the cache stop being grafted while the others still are."""
    from edgespec.drafters.ngram import AGREES, DISAGREES, NGRAM, NO_SUFFIX, ONE_TOKEN, is_ngram, kind_of, relation

    assert relation(5, None) == relation(5, set()) == NO_SUFFIX
    assert relation(5, {5, 7}) == AGREES and relation(5, {7}) == DISAGREES
    toks = [1, 2, 3, 4, 9, 1, 2, 3]  # "1 2 3" occurred before, followed by 4
    ng = NgramDrafter()
    assert ng.look(toks) == ([4, 9, 1, 2, 3], kind_of(NGRAM))
    assert ng.look(toks, lambda: {4})[1] == kind_of(NGRAM, AGREES)
    assert ng.look(toks, lambda: {8})[1] == kind_of(NGRAM, DISAGREES)
    one = [7, 4, 1, 3, 7]  # only the last token occurred before
    assert ng.look(one, lambda: {8})[1] == kind_of(ONE_TOKEN, DISAGREES)
    assert is_ngram(kind_of(NGRAM, DISAGREES)) and not is_ngram(kind_of(ONE_TOKEN, AGREES))
    asked = []
    NgramDrafter().look([7, 8, 9], lambda: asked.append(1) or {1})
    assert not asked  # no lookup: the suffix cache is not consulted

    from edgespec.controller.cost import CostModel

    cost = CostModel.from_tables({1: 0.012, 2: 0.016, 4: 0.020, 8: 0.028, 16: 0.044}, {1: 0.005})
    ng = NgramDrafter()
    against, alone = kind_of(NGRAM, DISAGREES), kind_of(NGRAM)
    ng.reach[against] = list(ng.reach[alone])  # start both alike: the evidence must separate them
    for _ in range(40):  # contradicting lookups miss, the others are taken whole
        ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3]
        ng._pending = []
        ng.look(ctx, lambda: {99})
        ng.score(ctx + [77] * 8)
        ng.look(ctx)
        ng.score(ctx + [4, 5, 6, 7, 8, 9, 10, 1])
    assert ng.reach[against][0] < 0.05 < 0.9 < ng.reach[alone][0]
    assert ng.budget(against, cost, 1, cost.verify_seconds(1)) == 0
    assert ng.budget(alone, cost, 1, cost.verify_seconds(1)) >= 4


def test_default_reach_distrusts_a_lookup_against_the_suffix_cache():
    from edgespec.drafters.ngram import AGREES, DISAGREES, N_KINDS, NGRAM, ONE_TOKEN, kind_of

    r = default_reach()
    assert len(r) == N_KINDS
    for match in (NGRAM, ONE_TOKEN):
        assert r[kind_of(match, AGREES)] == r[kind_of(match)]
        assert all(a < b for a, b in zip(r[kind_of(match, DISAGREES)], r[kind_of(match)]))


def _prompt_only(monkeypatch) -> None:
    """Ticks read the prompt without taking the first step along: the steps under test are
    begun by hand at the prompt's end."""
    from edgespec.session import Session

    monkeypatch.setattr(Session, "fuses_first", property(lambda self: False))


def test_a_session_keys_its_lookup_by_the_suffix_cache_proposal_of_that_step(monkeypatch):
    from edgespec.drafters.ngram import DISAGREES, NGRAM, kind_of
    from edgespec.sampling import SamplingParams
    from edgespec.types import GenerationRequest, SpeculationParams
    from tests.fake_backend import fake_backed_engine

    _prompt_only(monkeypatch)
    prompt = (10, 1, 2, 3, 4, 9, 1, 2, 3)  # the prompt's own "1 2 3" was followed by 4
    for cached, kind in (([30, 31, 1, 2, 3, 5, 6, 7, 8], kind_of(NGRAM, DISAGREES)),  # a reply went 1 2 3 5
                         ([30, 31, 1, 2, 3, 4, 9, 7, 8], kind_of(NGRAM, 1)),  # ... or 1 2 3 4: agrees
                         (None, kind_of(NGRAM))):
        eng = fake_backed_engine(parallel=1, suffix_cache=True)
        if cached:
            eng.suffix_cache.insert("", (20, 21), cached)
        s = eng.open_session(GenerationRequest(prompt, SamplingParams(max_tokens=8), SpeculationParams(mode="auto")))
        while s.prefilling:
            eng.tick([s])
        s.begin_step(PLAIN)
        assert s.record.lookup[0] == 4 and s.record.kind == kind, cached
        s.cancel_step()
        s.close()


def test_a_step_the_guard_holds_bare_looks_nothing_up(monkeypatch):
    """The goodput guard's bare steps graft nothing, so they skip the lookup and the suffix
    cache's proposal too (Python time that a fast forward would feel)."""
    from edgespec.sampling import SamplingParams
    from edgespec.types import GenerationRequest, SpeculationParams
    from tests.fake_backend import fake_backed_engine

    _prompt_only(monkeypatch)
    eng = fake_backed_engine(parallel=1, suffix_cache=True)
    eng.suffix_cache.insert("", (20, 21), [30, 31, 1, 2, 3, 5, 6, 7, 8])
    s = eng.open_session(GenerationRequest((10, 1, 2, 3, 4, 9, 1, 2, 3), SamplingParams(max_tokens=8),
                                           SpeculationParams(mode="auto")))
    while s.prefilling:
        eng.tick([s])
    looked = []
    look = s.suffix.look
    s.suffix.look = lambda toks, *a, **k: looked.append(1) or look(toks, *a, **k)
    s.begin_step(PLAIN, bare=True)
    assert s.record.bare and not s.record.lookup and not looked
    s.cancel_step()
    s.begin_step(PLAIN)
    assert s.record.lookup and looked
    s.cancel_step()
    s.close()
