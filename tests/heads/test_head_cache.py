"""What a head keeps of a finished request's context for the next one (drafters/eagle3.py,
HeadCache): index P of the context (a head position, or the encoded target features not yet
absorbed) needs tokens 0..P+1 alike, and the root's parent is always decoded again."""

from __future__ import annotations

import numpy as np

from edgespec.drafters.eagle3 import HeadCache, reusable

CONTEXT = list(range(100, 130))  # 30 tokens: a prompt and its reply


def cache(n_past: int, n_features: int) -> HeadCache:
    g = np.zeros((n_features - n_past, 4), dtype=np.float32) if n_features > n_past else None
    return HeadCache(tuple(CONTEXT[:n_features + 1]), n_past, g)


def test_a_context_that_continues_keeps_every_index_the_head_has():
    turn = CONTEXT + [7, 8, 9]  # the next turn of a chat
    assert cache(29, 29).reusable(turn) == 29
    assert cache(10, 29).reusable(turn) == 29  # positions and unabsorbed features alike
    assert cache(10, 20).reusable(turn) == 20


def test_index_p_needs_the_tokens_up_to_p_plus_one():
    other = CONTEXT[:12] + [1, 2, 3, 4, 5]  # differs from index 12 on
    assert cache(29, 29).reusable(other) == 11  # index 11 read token 12: not this context's


def test_the_roots_parent_is_decoded_again():
    same = CONTEXT[:21]  # a prompt whose root is CONTEXT[20]; its parent is index 19
    # the head had not absorbed index 19: its kept features decode it again, nothing is recomputed
    assert cache(5, 25).reusable(same) == 20
    # the head had absorbed it (it drafted past it): the target's features of index 19 are needed
    assert cache(25, 25).reusable(same) == 19


def test_nothing_kept_gives_nothing():
    assert reusable(None, CONTEXT) == 0
    assert cache(29, 29).reusable([5, 6, 7]) == 0
    assert cache(29, 29).reusable([100]) == 0


class _Head:
    """A head context that counts its encodes (the fc: here the first 4 feature columns, doubled)."""

    n_seq_max = 2
    n_ctx = 4096

    def __init__(self) -> None:
        self.ctx = self
        self.encodes: list[int] = []

    def encode(self, features: np.ndarray) -> np.ndarray:
        self.encodes.append(len(features))
        return 2 * features[:, :4]

    def seq_rm(self, *args) -> None:
        pass

    def clear(self) -> None:
        pass


def test_features_are_encoded_once_when_the_head_reads_them():
    """A request whose steps graft other sources' drafts hands the head the target's features
    every step; they wait raw and are encoded in one call when the head next reads them (here
    the kept cache), in context order, the same rows a call per step would give."""
    from edgespec.drafters.eagle3 import Eagle3Drafter

    head = _Head()
    d = Eagle3Drafter(head)
    d.begin(CONTEXT[:10])
    rng = np.random.default_rng(0)
    steps = [rng.standard_normal((n, 12)).astype(np.float32) for n in (9, 1, 3, 2)]  # prefill, then steps
    for f in steps:
        d.add_features(f)
    assert head.encodes == [] and d.n_features == 15 and d.n_past == 0
    kept = d.keep(CONTEXT[:16])
    assert head.encodes == [15]  # one call for the four steps
    np.testing.assert_array_equal(kept.g, 2 * np.concatenate(steps)[:, :4])
    assert kept.n_features == 15 and kept.tokens == tuple(CONTEXT[:16])
