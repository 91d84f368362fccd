import pytest

from edgespec.controller import ControllerConfig, ShapePolicy, chain, eagle, runner_ups
from edgespec.controller.policy import chain_tokens, runner_ups_tokens, sibling_probs
from edgespec.controller.sim import cpu_cost, gpu_cost


def flat(top1, depths=16, ranks=4, rest=0.35):
    return [[top1] + [rest] * (ranks - 1) for _ in range(depths)]


def policy(**kw):
    return ShapePolicy(ControllerConfig(**kw), max_depth=16, max_nodes=64)


def test_expected_tokens_formulas():
    a = flat(0.5)
    assert chain_tokens(a, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    # runner-ups: advance at depth 1 with 1 - 0.5 * 0.65; only the chain child continues
    q = 1 - 0.5 * 0.65
    assert runner_ups_tokens(a, 2, 1) == pytest.approx(1 + q + 0.5 * q)
    # an EAGLE tree that is a chain (width 1) gives the chain's value
    pol = policy()
    e_chain, _ = pol.evaluate(chain(4), a, cpu_cost())
    e_tree, _ = pol.evaluate(eagle(4, 1, 1, 4), a, cpu_cost())
    assert e_tree == pytest.approx(e_chain)
    # a full width-2 tree of depth 1 = top-2 acceptance
    p = sibling_probs(a)
    assert p[0][1] == pytest.approx(0.5 * 0.35)
    e_w2, _ = pol.evaluate(eagle(1, 2, 1, 2), a, cpu_cost())
    assert e_w2 == pytest.approx(1 + 0.5 + 0.5 * 0.35)


def test_best_is_argmax_of_evaluate():
    pol = policy()
    a, cost = flat(0.8), cpu_cost()
    best = pol.best(a, cost)
    e, s = pol.evaluate(best.shape, a, cost)
    assert best.rate == pytest.approx(e / s)
    for shape in (chain(1), chain(4), runner_ups(3, 1), eagle(6, 4, 4, 16), eagle(3, 2, 2, 8)):
        e, s = pol.evaluate(shape, a, cost)
        assert e / s <= best.rate + 1e-12


def test_shape_grows_when_verification_is_cheap():
    pol = policy()
    a = flat(0.75)
    cpu, gpu = pol.best(a, cpu_cost()), pol.best(a, gpu_cost())
    assert gpu.shape.nodes > cpu.shape.nodes
    assert gpu.shape.depth >= cpu.shape.depth
    assert gpu.shape.mode == "tree" and gpu.shape.nodes >= 16
    # and shrinks when verification gets expensive: same draft, a target whose time grows with the batch
    from edgespec.controller import CostModel
    from edgespec.controller.sim import GPU_DRAFT

    steep = CostModel.from_tables({1: 0.010, 2: 0.014, 4: 0.022, 8: 0.038, 16: 0.07}, GPU_DRAFT)
    assert pol.best(a, steep).shape.nodes < gpu.shape.nodes


def test_cpu_high_acceptance_prefers_chains_over_deep_trees():
    pol = policy()
    a, cost = flat(0.9), cpu_cost()
    best = pol.best(a, cost)
    assert best.shape.kind in ("chain", "runner_ups")
    e, s = pol.evaluate(eagle(6, 4, 4, 16), a, cost)
    assert e / s < 0.9 * best.rate
    assert best.speedup > 1.2


def test_cheap_tree_can_be_the_only_tree_that_pays():
    # drafting dominates: the runner-ups tree costs a chain's drafting, EAGLE trees pay per level
    pol = policy(enable_chain=False)
    a, cost = [[0.55, 0.45, 0.4, 0.35]] * 16, cpu_cost()
    best = pol.best(a, cost)
    assert best.shape.kind == "runner_ups"


def test_candidate_set_is_small_and_respects_limits():
    pol = policy()
    assert 20 < pol.n_candidates <= 300
    best = pol.best(flat(0.8), gpu_cost())
    assert best.evaluated == pol.n_candidates
    small = ShapePolicy(ControllerConfig(), max_depth=3, max_nodes=8, max_leaves=4)
    for shape in (small.best(flat(x), gpu_cost()).shape for x in (0.3, 0.6, 0.95)):
        assert shape.depth <= 3 and shape.nodes <= 8
    only_chain = policy(enable_tree=False, enable_runner_ups=False)
    assert only_chain.best(flat(0.9), gpu_cost()).shape.mode == "chain"


def test_without_draft_model_only_free_ngram_chains():
    pol = ShapePolicy(ControllerConfig(), max_depth=8, max_nodes=16, has_draft_model=False)
    assert pol.runner_ups == [] and pol.eagle == []
    best = pol.best(flat(0.6), cpu_cost())
    assert best.shape.mode == "chain"
    off = ShapePolicy(ControllerConfig(enable_ngram=False), max_depth=8, max_nodes=16, has_draft_model=False)
    assert not off.has_speculative


def test_a_chains_stop_levels_follow_the_economics_and_never_exceed_stop_prob():
    """Drafting level j + 1 costs a draft forward plus the verification's extra width and is worth
    a[j][0] x the path estimate tokens: below marginal x rate / a[j][0] it stops. With the draft a
    third of a forward (the demo pair) the cap, stop_prob, binds at every level; with a draft at 13 %
    and 4-token kernels (T(3) priced as T(4): the third drafted token costs one draft forward
    only) a chain does not stop short at 0.6."""
    from edgespec.controller import CostModel
    from edgespec.shape import Shape

    policy = ShapePolicy(ControllerConfig(), max_depth=8, max_nodes=16)
    a = [[0.75, 0.3, 0.2, 0.2]] * 8
    cheap = CostModel.from_tables({1: 0.1025, 2: 0.161, 3: 0.186, 4: 0.133, 8: 0.257, 16: 0.316}, {1: 0.0135})
    dear = CostModel.from_tables({1: 0.0196, 2: 0.0204, 4: 0.0245, 8: 0.0349, 16: 0.0408}, {1: 0.007})
    for cost, binds in ((cheap, False), (dear, True)):
        tokens, secs = policy.evaluate(chain(3, 0.6), a, cost)
        levels = policy.stop_levels(chain(3, 0.6), a, cost, tokens / secs)
        assert len(levels) == 2 and all(0 < x <= 0.6 for x in levels)
        assert (levels == (0.6, 0.6)) == binds, levels
    tokens, secs = policy.evaluate(chain(3, 0.6), a, cheap)
    third = policy.stop_levels(chain(3, 0.6), a, cheap, tokens / secs)[1]
    assert third == pytest.approx(0.0135 * tokens / secs / 0.75)  # one draft forward, no extra width
    assert third < 0.75 * 0.75  # so a path of two accepted-looking tokens goes on to a third
    assert policy.stop_levels(chain(3, 0.0), a, cheap, 10.0) == ()  # no stop rule: none
    assert policy.stop_levels(runner_ups(3, 1, 0.6), a, cheap, 10.0) == ()  # trees keep stop_prob
    s = Shape("chain", depth=4, nodes=4, stop_prob=0.6, stop_levels=(0.2, 0.3))
    assert [s.stop_at(level) for level in (1, 2, 3, 4)] == [0.2, 0.3, 0.6, 0.6]
