"""Under `prompt_cache_scope = "caller"` nothing another caller left in a slot serves a request or
counts in its figures: a finished request's kept prefill, a running one's published prefill, the
draft's cache and what idle work added to it. Under "pooled" all of it does (the fake backend:
reuse in whole 64-token chunks)."""

from __future__ import annotations

import pytest

from edgespec.sampling import SamplingParams
from edgespec.types import GenerationRequest, SpeculationParams
from tests.fake_backend import fake_backed_engine

SECRET = [1] + [(7 * i) % 50 + 5 for i in range(150)]  # what only alice sends


def _req(toks, caller: str, max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(tuple(toks), SamplingParams(max_tokens=max_tokens), SpeculationParams(mode="auto"),
                             caller=caller)


def _reuse(result) -> tuple[int, int]:
    return result.stats.cached_prompt_tokens, result.stats.draft_cached_tokens


@pytest.mark.parametrize("parallel", [1, 3])
def test_a_finished_requests_caches_serve_its_caller_only(parallel):
    eng = fake_backed_engine(parallel=parallel, n_ctx=512, prompt_cache_bytes=0)  # the slots alone
    eng.generate(_req(SECRET, "token:alice"))
    while eng.idle_work():  # idle time brings the draft up to alice's whole context
        pass
    probe = SECRET + [9, 9, 9]
    assert _reuse(eng.generate(_req(probe, "token:bob"))) == (0, 0)
    assert _reuse(eng.generate(_req(probe, "anonymous"))) == (0, 0)
    cached, draft_cached = _reuse(eng.generate(_req(probe, "token:alice")))
    if parallel == 1:  # bob's requests took alice's slot: she prefills again, and keeps it again
        assert (cached, draft_cached) == (0, 0)
        while eng.idle_work():
            pass
        cached, draft_cached = _reuse(eng.generate(_req(probe, "token:alice")))
    assert cached == 128 and draft_cached > 0


def test_a_running_requests_published_prefill_serves_its_caller_only():
    eng = fake_backed_engine(parallel=3, n_ctx=512, prompt_cache_bytes=0)
    alice = eng.open_session(_req(SECRET, "token:alice", max_tokens=40))
    while alice.prefilling:
        eng.tick([alice])
    assert alice.slot.prefill  # read: published to the other slots
    bob = eng.open_session(_req(SECRET + [3], "token:bob"))
    assert bob.slot is not alice.slot and (bob.stats.cached_prompt_tokens, bob.stats.draft_cached_tokens) == (0, 0)
    again = eng.open_session(_req(SECRET + [4], "token:alice"))
    assert again.stats.cached_prompt_tokens == 128
    for s in (alice, bob, again):
        s.close()


def test_pooled_shares_every_slot_cache():
    eng = fake_backed_engine(parallel=1, n_ctx=512, prompt_cache_bytes=0, prompt_cache_scope="pooled")
    eng.generate(_req(SECRET, "token:alice"))
    while eng.idle_work():
        pass
    cached, draft_cached = _reuse(eng.generate(_req(SECRET + [9], "token:bob")))
    assert cached == 128 and draft_cached > 0


def test_a_foreign_slot_is_emptied_before_another_caller_uses_it():
    """The prompt store keeps alice's prefill in her partition when bob's request takes her slot."""
    eng = fake_backed_engine(parallel=1, n_ctx=512)
    eng.generate(_req(SECRET, "token:alice"))
    eng.generate(_req(SECRET + [9], "token:bob"))
    assert eng.slots[0].caller == "token:bob" and len(eng.prompt_store) == 1
    assert list(eng.prompt_store.candidates("token:bob")) == []
    assert eng.generate(_req(SECRET + [9], "token:alice")).stats.cached_prompt_tokens == 128


def test_another_callers_request_takes_the_least_recently_used_slot():
    """Bob's request, which can reuse nothing, takes the slot alice used least recently, and
    leaves her the one she used last (its draft cache included)."""
    eng = fake_backed_engine(parallel=2, n_ctx=512, prompt_cache_bytes=0)
    eng.generate(_req([2] + SECRET[1:], "token:alice"))  # slot 0
    eng.generate(_req(SECRET, "token:alice"))  # slot 1: the least recently used of two empty ones
    while eng.idle_work():
        pass
    assert eng.slots[1].prefill == tuple(SECRET[:-1])
    eng.generate(_req([3] * 100, "token:bob"))
    assert eng.slots[0].caller == "token:bob" and eng.slots[1].caller == "token:alice"
    assert _reuse(eng.generate(_req(SECRET + [9], "token:alice")))[1] > 0
