"""KV invariants per cell after every tick (fake backend, whose cache lists its cells): each
position of a session's main sequence exactly once, holding the context's token, and no branch
cell surviving the tick. A broken target batch that puts every tree node into every leaf's
sequence leaves rejected siblings in the main sequence at positions it already holds: only a
per-cell check sees it (the main sequence still spans [0, len - 2])."""

from __future__ import annotations

import pytest

from edgespec.sampling import SamplingParams
from edgespec.session import Session
from edgespec.types import GenerationRequest, SpeculationParams
from tests.fake_backend import fake_backed_engine

PROMPTS = [(0, 5, 9, 14), (0, 7, 7, 7, 21, 30), (0, 11)]


def run(temperature: float = 0.0, ticks: int = 12) -> None:
    eng = fake_backed_engine(parallel=3)
    sess = [eng.open_session(GenerationRequest(p, SamplingParams(max_tokens=30, temperature=temperature, seed=i),
                                               SpeculationParams(mode="tree", tree_nodes=12, tree_depth=4)))
            for i, p in enumerate(PROMPTS)]
    for s in sess:
        s.check_kv = True
    try:
        for _ in range(ticks):
            eng.tick([s for s in sess if not s.done])
    finally:
        for s in sess:
            s.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_per_cell_invariants_hold_after_every_tick(temperature):
    run(temperature)


def test_every_node_in_every_leafs_sequence_is_caught(monkeypatch):
    real = Session.target_batch

    def smeared(self):
        toks, pos, seqs = real(self)
        every = sorted({q for ss in seqs for q in ss})
        return toks, pos, [list(every) for _ in seqs]

    monkeypatch.setattr(Session, "target_batch", smeared)
    with pytest.raises(AssertionError, match="positions are not"):
        run()


def test_the_coarse_check_alone_misses_it(monkeypatch):
    """What the per-cell check adds: with it removed, the smeared batch passes (min/max of seq 0
    and empty branch sequences hold)."""
    real = Session.target_batch

    def smeared(self):
        toks, pos, seqs = real(self)
        every = sorted({q for ss in seqs for q in ss})
        return toks, pos, [list(every) for _ in seqs]

    monkeypatch.setattr(Session, "target_batch", smeared)
    from tests.fake_backend import FakeContext

    monkeypatch.delattr(FakeContext, "seq_cells")
    run()
