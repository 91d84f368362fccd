"""The per-request choice between a draft model and an EAGLE-3 head (controller/drafter_choice.py),
on constructed cost curves and acceptances with known answers."""

from __future__ import annotations

import pytest

from edgespec.controller import AcceptancePrior, CostModel
from edgespec.controller.drafter_choice import DrafterChoice, estimate

SIZES = (1, 2, 3, 4, 6, 8, 12, 16)


def _cost() -> CostModel:
    """A CPU-like target (20 ms + 2.4 ms a token), a Q8_0-like draft (3 ms + 1 ms a token) and a
    head (1 ms + 0.2 ms a token)."""
    return CostModel(tables={"target": {n: 0.020 + 0.0024 * n for n in SIZES},
                             "draft": {n: 0.003 + 0.001 * n for n in SIZES},
                             "head": {n: 0.001 + 0.0002 * n for n in SIZES}})


def _prior(a: float) -> AcceptancePrior:
    p = AcceptancePrior()
    p.rates = [[a] * p.ranks for _ in range(p.depths)]
    return p


DRAFT, HEAD = [0.9] * 8, [0.7] * 8  # top-1 acceptance by depth: an accurate draft model, a rougher head


def test_alone_the_accurate_draft_model_pays_more_and_under_load_the_cheap_head():
    cost = _cost()
    alone = estimate(DRAFT, cost.drafting("draft"), 1), estimate(HEAD, cost.drafting("head"), 1)
    assert alone[0] == pytest.approx(1.91, abs=0.02) and alone[1] == pytest.approx(1.71, abs=0.02)
    four = estimate(DRAFT, cost.drafting("draft"), 4), estimate(HEAD, cost.drafting("head"), 4)
    assert four[1] > four[0]  # the draft model's whole forward now costs more than its tokens bring
    assert four[1] == pytest.approx(1.048, abs=0.01)


def test_a_drafter_whose_forward_others_already_run_costs_only_its_share():
    cost = _cost().drafting("draft")
    # three sessions already draft with the model: one more token in each of its forwards costs 1 ms
    assert estimate(DRAFT, cost, 4, sharing=3) > estimate(DRAFT, cost, 4, sharing=0) + 0.1


def test_the_measured_model_bias_discounts_a_drafter():
    cost = _cost().drafting("head")
    assert estimate(HEAD, cost, 1, spec_bias=1.25) == pytest.approx(estimate(HEAD, cost, 1) / 1.25)


def test_a_useless_drafter_never_beats_plain_decoding():
    assert estimate([0.0] * 8, _cost().drafting("draft"), 1) < 1.0


def test_the_choice_follows_the_load_once_both_were_tried():
    cost = _cost()
    options = {"model": (_prior(0.9), cost.drafting("draft")), "eagle3": (_prior(0.7), cost.drafting("head"))}
    choice = DrafterChoice(min_requests=1, explore_every=1000)
    # each is tried first, in turn
    assert [choice.choose(options, load=1, sharing={}) for _ in range(2)] == ["model", "eagle3"]
    assert choice.choose(options, load=1, sharing={}) == "model"
    assert choice.choose(options, load=4, sharing={}) == "eagle3"
    assert choice.last["eagle3"] > choice.last["model"]


def test_the_runner_up_is_tried_now_and_then_where_its_estimate_is_close():
    cost = _cost()
    options = {"model": (_prior(0.9), cost.drafting("draft")), "eagle3": (_prior(0.7), cost.drafting("head"))}
    choice = DrafterChoice(min_requests=0, explore_every=4)
    picks = [choice.choose(options, load=1, sharing={}) for _ in range(16)]  # 1.91 against 1.71
    assert picks.count("eagle3") == 4 and picks[3] == picks[7] == "eagle3"
    # a draft model whose forwards cost 10x (a big draft beside a small target): never tried, not
    # even on its first requests
    slow = CostModel(tables={"target": {n: 0.020 + 0.0024 * n for n in SIZES},
                             "draft": {n: 0.03 + 0.01 * n for n in SIZES},
                             "head": {n: 0.001 + 0.0002 * n for n in SIZES}})
    options = {"model": (_prior(0.9), slow.drafting("draft")), "eagle3": (_prior(0.7), slow.drafting("head"))}
    choice = DrafterChoice(min_requests=2, explore_every=2)
    assert [choice.choose(options, load=1, sharing={}) for _ in range(8)] == ["eagle3"] * 8
    assert choice.last["model"] < 0.85 * choice.last["eagle3"]


def test_the_cost_views_price_each_drafter_on_its_own_curve():
    cost = _cost()
    cost.rows["head"] = 0.0005
    assert cost.drafting("draft") is cost
    h = cost.drafting("head")
    assert h.draft_seconds(4) == pytest.approx(0.0018) and h.draft_row == 0.0005
    assert h.expand_seconds(3) == pytest.approx(0.0016 + 2 * 0.0005)
    assert h.verify_seconds(4) == cost.verify_seconds(4)  # one target
    assert cost.draft_seconds(4) == pytest.approx(0.007)
    with pytest.raises(ValueError, match="drafter kind"):
        cost.drafting("target")


def test_what_a_drafter_costs_once_counts_over_the_requests_tokens():
    """The head would recompute a 200-token prefill the slot keeps for the draft model (0.5 s):
    over 16 tokens that outweighs its cheaper steps at four streams; over 2,000 it does not."""
    cost = _cost()
    options = {"model": (_prior(0.9), cost.drafting("draft")), "eagle3": (_prior(0.7), cost.drafting("head"))}
    once = {"model": 0.0, "eagle3": 0.5}
    choice = DrafterChoice(min_requests=0, explore_every=1000)
    assert choice.choose(options, load=4, sharing={}) == "eagle3"
    assert choice.choose(options, load=4, sharing={}, tokens=16, once=once) == "model"
    assert choice.last["eagle3"] < 0.5 < choice.last["model"]
    assert choice.choose(options, load=4, sharing={}, tokens=2000, once=once) == "eagle3"
