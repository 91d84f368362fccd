"""The prompt store (edgespec/prompt_store.py): kept prefills in host memory, least recently used
out beyond its bytes, one partition per caller unless pooled (pure: entries of made-up bytes)."""

from __future__ import annotations

import numpy as np

from edgespec.drafters.eagle3 import HeadCache
from edgespec.prompt_store import PromptStore, StoredPrompt


def entry(part: str, tokens, n: int = 1000, head: HeadCache | None = None) -> StoredPrompt:
    return StoredPrompt(part, tuple(tokens), bytes(n), head, bytes(100) if head else b"")


def test_bounded_in_bytes_least_recently_used_out():
    store = PromptStore(max_bytes=3500)
    a, b, c, d = (entry("", [k] * 10) for k in range(4))
    for e in (a, b, c):
        assert store.put(e)
    assert store.bytes == 3 * a.nbytes <= 3500 and len(store) == 3
    store.used(a, 9)  # a served a request: b is now the least recently used
    assert store.put(d)
    assert set(store.candidates("")) == {a, c, d} and store.bytes <= 3500
    assert store.figures()["evicted"] == 1 and store.figures()["hits"] == 1
    assert not store.put(entry("", [9] * 10, n=4000))  # larger than the whole store: not kept
    assert store.bytes <= 3500
    for k in range(10_000):  # a long run stays within the bound
        store.put(entry("", [k, k + 1, k + 2], n=int(k % 7) * 100 + 50))
        assert store.bytes <= 3500
    assert store.bytes == sum(e.nbytes for e in store.candidates(""))


def test_one_partition_per_caller_unless_pooled():
    store = PromptStore(max_bytes=1 << 20)
    store.put(entry(store.partition_of("token:alice"), [1, 2, 3]))
    assert [e.prefill for e in store.candidates("token:alice")] == [(1, 2, 3)]
    assert list(store.candidates("token:bob")) == [] and list(store.candidates("")) == []
    pooled = PromptStore(max_bytes=1 << 20, pooled=True)
    pooled.put(entry(pooled.partition_of("token:alice"), [1, 2, 3]))
    assert len(list(pooled.candidates("token:bob"))) == 1


def test_an_entry_replaces_those_it_covers():
    """The same prefill again, or a longer one that starts with it, replaces the older entry of
    that partition; an entry with head positions is replaced only by one holding them too."""
    store = PromptStore(max_bytes=1 << 20)
    store.put(entry("", [1, 2, 3]))
    store.put(entry("", [1, 2, 3, 4]))  # covers [1, 2, 3]
    store.put(entry("x", [1, 2, 3, 4, 5]))  # another partition: covers nothing of ""
    assert [e.prefill for e in store.candidates("")] == [(1, 2, 3, 4)]
    head = HeadCache((1, 2, 3, 4, 5), 3, np.zeros((1, 4), np.float32))
    store.put(entry("", [1, 2, 3, 4], head=head))
    assert [e.head for e in store.candidates("")] == [head]
    store.put(entry("", [1, 2, 3, 4, 5]))  # no head: the entry with one stays
    assert {e.head is None for e in store.candidates("")} == {True, False}
    store.put(entry("", [1, 2, 3, 4, 5, 6], head=HeadCache((1, 2, 3, 4, 5, 6), 5, None)))
    assert [e.prefill for e in store.candidates("")] == [(1, 2, 3, 4, 5, 6)]
    assert store.holds("", (1, 2, 3), None) and store.holds("", (1, 2, 3, 4, 5, 6), head)
    assert not store.holds("x", (1, 2, 3, 4, 5, 6), None) and not store.holds("", (1, 2, 7), None)
    store.clear()
    assert store.bytes == 0 and len(store) == 0


def _generate(eng, toks, caller=""):
    from edgespec.sampling import SamplingParams
    from edgespec.types import GenerationRequest, SpeculationParams

    return eng.generate(GenerationRequest(tuple(toks), SamplingParams(max_tokens=12),
                                          SpeculationParams(mode="auto"), caller=caller))


def test_the_engine_writes_a_dropped_prefill_back_and_survives_a_full_cache(monkeypatch):
    """One slot (the fake backend, reuse in whole n_batch chunks): a prompt, another, the first
    again: the first's kept chunks come back from the store and the output is the same. When the
    cache has no room for an entry's cells the request prefills everything instead, and still
    gives the same output."""
    from edgespec.errors import ModelError
    from tests.fake_backend import fake_backed_engine

    eng = fake_backed_engine(parallel=1, n_ctx=512)
    assert eng.prompt_store is not None and eng.reuse_chunk == 64
    first = [1] + [(7 * i) % 50 + 5 for i in range(150)]
    second = [2] + [(11 * i) % 50 + 5 for i in range(150)]
    want = _generate(eng, first)
    assert want.stats.cached_prompt_tokens == 0
    _generate(eng, second)
    assert len(eng.prompt_store) == 1
    again = _generate(eng, first)
    assert again.stats.cached_prompt_tokens == 128 and again.token_ids == want.token_ids
    assert eng.tick_totals["prompt_store_hits"] == 1 and eng.tick_totals["prompt_store_restored_tokens"] == 128
    assert _generate(eng, second, caller="token:bob").stats.cached_prompt_tokens == 0  # not bob's

    def full(self, seq, data):
        raise ModelError("could not restore: no room")

    monkeypatch.setattr(type(eng.target_ctx), "load_seq_state", full)
    _generate(eng, second)
    got = _generate(eng, first)
    assert got.stats.cached_prompt_tokens == 0 and got.token_ids == want.token_ids
    assert eng.slots[0].prefill == tuple(first[:-1])  # read whole, and kept as usual
