"""A Session's explicit state (SessionState) through a request's life, on the fake backend:
what the tick sorts sessions by, and what decides whether the slot keeps its caches."""

from __future__ import annotations

import pytest

from edgespec.errors import ForwardAborted
from edgespec.sampling import SamplingParams
from edgespec.session import SessionState
from edgespec.types import GenerationRequest, SpeculationParams
from tests.fake_backend import fake_backed_engine


def req(prompt, mode="plain", max_tokens=6):
    return GenerationRequest(tuple(prompt), SamplingParams(max_tokens=max_tokens), SpeculationParams(mode=mode))


LONG = [0] + [5 + i % 40 for i in range(150)]  # more than one n_batch (64) piece


def test_a_request_reads_its_prompt_then_steps_then_closes():
    eng = fake_backed_engine(parallel=1, n_ctx=512)
    s = eng.open_session(req(LONG, "chain"))
    assert s.state is SessionState.PREFILLING and s.prefilling and s.consistent
    while s.prefilling:
        eng.tick([s])
    # chain keeps its shape from the start: no fused first step, the prompt is just read
    assert s.state is SessionState.READY and s.record is None
    s.begin_step(s.decide().shape)
    assert s.state is SessionState.STEPPING and not s.consistent and not s.prefilling
    s.cancel_step()
    assert s.state is SessionState.READY and s.consistent
    while not s.done:
        eng.tick([s])
        assert s.state is SessionState.READY  # observe ends every step
    s.close()
    assert s.state is SessionState.CLOSED and s.done
    assert eng.slots[0].prefill == tuple(LONG[:-1])  # ended consistent: the prefill is kept


def test_a_fused_first_step_begins_while_the_prompt_is_read():
    """plain and auto take their first step in the forward that reads the prompt's last piece:
    the step begins while PREFILLING and the session counts as prefilling until the piece is in."""
    eng = fake_backed_engine(parallel=1, n_ctx=512)
    s = eng.open_session(req(LONG, "plain"))
    seen = []
    real = s.prefill_done

    def spy(n, features=None):
        seen.append((s.state, s.prefilling))
        real(n, features)
        seen.append((s.state, s.prefilling))

    s.prefill_done = spy
    while s.prefilling:
        eng.tick([s])
    assert seen[-2] == (SessionState.STEPPING, True)  # the last piece: the first step begun
    assert seen[-1] == (SessionState.STEPPING, False)  # ... and the prompt read
    assert s.state is SessionState.READY and len(s.out) == 1
    s.close()


def test_an_aborted_forward_leaves_the_slot_nothing():
    eng = fake_backed_engine(parallel=1, n_ctx=512)
    s = eng.open_session(req([0, 5, 9, 14], "chain", max_tokens=20))
    while s.prefilling:
        eng.tick([s])
    eng.tick([s])

    eng.target_ctx.before_decode = lambda tokens: eng.target_ctx.abort()  # the deadline watch's abort
    with pytest.raises(ForwardAborted):
        eng.tick([s])
    eng.target_ctx.before_decode = lambda tokens: None
    assert s.state is SessionState.ABANDONED and not s.consistent
    s.close("cancelled")
    assert s.state is SessionState.CLOSED and s.finish_reason == "cancelled"
    assert eng.slots[0].prefill == () and eng.slots[0].last_context == ()


def test_a_drafter_judged_not_to_pay_is_dropped_once_for_auto_only():
    """session_parts.draft_range reads calibration's verdict, once: an auto session gets no drafter and
    its controller knows it has none; an explicit chain still drafts with it."""
    eng = fake_backed_engine(parallel=2, n_ctx=512)
    eng.draft_verdicts["draft"] = {"pays": False}
    auto = eng.open_session(req([0, 5, 9, 14], "auto", max_tokens=8))
    chain = eng.open_session(req([0, 5, 9, 14], "chain", max_tokens=8))
    assert auto.draft_range is None and auto.drafter is None
    assert auto.controller is not None and not auto.controller.policy.has_draft_model
    assert chain.draft_range is chain.slot.draft and chain.drafter is not None
    auto.close()
    chain.close()
    eng.draft_verdicts.clear()
    again = eng.open_session(req([0, 5, 9, 14], "auto", max_tokens=8))
    assert again.drafter is not None and again.controller.policy.has_draft_model
    again.close()
