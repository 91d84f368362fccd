"""The draft model's drafter (edgespec/drafters/model.py) on the demo pair's draft: the stop rule
cuts levels that are unlikely to be accepted, the spine probabilities it reports stay on the
final tree, and a kept draft cache is reused up to the prefix it shares."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.sampling import SamplingParams

pytestmark = pytest.mark.slow


def test_draft_stops_early_below_stop_prob(engine):
    """A chain stops growing once the draft's path probability falls below stop_prob (auto's
    default 0.6): the draft forwards it saves are those least likely to be accepted."""
    from edgespec.controller.shapes import chain
    from edgespec.drafters import ModelDrafter
    from edgespec.tree import DraftTree

    slot = next(s for s in engine.slots if not s.busy)
    toks = engine.encode_chat([("user", "Write a haiku about the sea, then explain its imagery.")])
    greedy = SamplingParams(max_tokens=8)
    from dataclasses import replace

    levels = {}
    shapes = {0.0: chain(6, 0.0), 0.6: chain(6, 0.6), 1.0: chain(6, 1.0),
              # the per-level thresholds the economics set (Shape.stop_levels) come before stop_prob
              "levels": replace(chain(6, 1.0), stop_levels=(0.0,) * 4)}
    for key, shape in shapes.items():
        drafter = ModelDrafter(slot.draft)
        drafter.begin(toks)
        tree = DraftTree.root(toks[-1])
        rep = drafter.propose(tree, toks, shape, greedy, np.random.default_rng(0))
        drafter.end()
        levels[key] = (rep.levels, len(tree) - 1)
    assert levels[0.0] == (6, 6)  # never stops
    assert levels[1.0] == (1, 1)  # a path probability is < 1 after one token: stops at once
    assert 1 <= levels[0.6][0] <= 6
    assert levels["levels"] == (5, 5)  # levels 2-5 drafted past stop_prob 1.0, then it stops


def test_draft_stop_rule_multiplies_the_calibrated_estimates(engine):
    """With a calibration the stop rule multiplies P(accepted | draft p) along the path instead of
    p: all-sure estimates never stop a 0.9 threshold, all-hopeless ones stop after level 1. The
    report carries the draft's probability of each first choice (what the calibration learns)."""
    from dataclasses import replace

    from edgespec.controller.shapes import chain
    from edgespec.drafters import ModelDrafter
    from edgespec.tree import DraftTree

    slot = next(s for s in engine.slots if not s.busy)
    toks = engine.encode_chat([("user", "Write a haiku about the sea, then explain its imagery.")])
    greedy = SamplingParams(max_tokens=8)
    got = {}
    for name, calib in (("sure", (0.999,) * 10), ("hopeless", (0.01,) * 10)):
        drafter = ModelDrafter(slot.draft)
        drafter.begin(toks)
        tree = DraftTree.root(toks[-1])
        rep = drafter.propose(tree, toks, replace(chain(6, 0.9), calib=calib), greedy, np.random.default_rng(0))
        drafter.end()
        got[name] = rep
    assert got["sure"].levels == 6 and got["hopeless"].levels == 1
    assert len(got["sure"].spine_probs) == 6 and len(got["hopeless"].spine_probs) == 1
    assert all(0.0 < p <= 1.0 for p in got["sure"].spine_probs)
    assert got["hopeless"].spine_probs[0] == got["sure"].spine_probs[0]  # same first draft token


def test_spine_probs_stop_where_pruning_cut_the_first_choices(engine):
    """A tree pruned to few nodes keeps its best paths; the calibration must only learn from
    first-choice tokens verification will actually see: spine_probs never reach deeper than the
    final tree's chain of first children."""
    from edgespec.controller.shapes import eagle
    from edgespec.drafters import ModelDrafter
    from edgespec.tree import DraftTree

    slot = next(s for s in engine.slots if not s.busy)
    toks = engine.encode_chat([("user", "List the planets of the solar system, comma separated.")])
    for nodes in (2, 4, 24):
        drafter = ModelDrafter(slot.draft)
        drafter.begin(toks)
        tree = DraftTree.root(toks[-1])
        rep = drafter.propose(tree, toks, eagle(6, 4, 2, nodes), SamplingParams(max_tokens=8), np.random.default_rng(0))
        drafter.end()
        children = tree.children()
        chain_len, n = 0, 0
        while children[n]:
            n = children[n][0]
            chain_len += 1
        assert 1 <= len(rep.spine_probs) <= chain_len
        assert len(tree) - 1 <= nodes


def test_draft_cache_reusable_prefix():
    from edgespec.drafters.model import DraftCache

    c = DraftCache(0, (1, 2, 3, 4, 5))
    assert c.reusable([1, 2, 3, 9, 9]) == 3
    assert c.reusable([1, 2, 3, 4, 5, 6, 7]) == 5  # all of it
    assert c.reusable([1, 2, 3, 4, 5]) == 4  # never the prompt's last token: the root is decoded by the proposal
    assert c.reusable([7, 2, 3]) == 0 and c.reusable([1]) == 0
    behind = DraftCache(3, (1, 2, 3, 4, 5, 6))  # cells from context index 3 on
    assert behind.reusable([1, 2, 3, 4, 9, 9]) == 4
    assert behind.reusable([1, 2, 3, 9, 9]) == 0  # shares nothing past the offset: no cell to keep
    assert behind.reusable([1, 2, 9, 4, 5, 6, 7]) == 0
