"""The request pipe under both APIs (edgespec/server/pipe.py): an event queue fed by a thread, as
the engine thread feeds a job's; the end-of-request check for every finish reason; request ids;
the capability check and the prompt's tokens (test_structured_api.py: both protocols use them)."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from edgespec.errors import BadRequest, Cancelled, DeadlineExceeded, ModelError, NotReady
from edgespec.server import pipe
from edgespec.server.config import LimitsConfig
from edgespec.types import Chunk, ConstraintSpec, GenerationResult, SpecStats
from tests.fake_engine import FakeEncoder


def result(reason: str, n: int = 3) -> GenerationResult:
    return GenerationResult("x" * n, list(range(n)), reason, 2, SpecStats())  # type: ignore[arg-type]


def feed(events: list[tuple], gap: float = 0.01) -> queue.SimpleQueue:
    """A queue a thread puts `events` on, `gap` seconds apart."""
    q: queue.SimpleQueue = queue.SimpleQueue()

    def run() -> None:
        for e in events:
            time.sleep(gap)
            q.put(e)

    threading.Thread(target=run, daemon=True).start()
    return q


CHUNKS = [("chunk", Chunk((i,), f"t{i}", None)) for i in range(4)]
NEVER = lambda: False  # the engine is there


def test_until_result_waits_through_every_chunk_and_stops_at_the_result():
    end = ("result", result("length"))
    q = feed([*CHUNKS, end, ("chunk", Chunk((9,), "after", None))])
    batch = pipe.next_events(q, until_result=True, stopped=NEVER, poll=0.001)
    assert batch == [*CHUNKS, end]  # all of them in one batch, nothing past the result
    assert q.get(timeout=5)[1].text == "after"  # left on the queue


def test_without_until_result_a_batch_is_what_is_queued_now():
    q: queue.SimpleQueue = queue.SimpleQueue()
    for e in CHUNKS[:2]:
        q.put(e)
    assert pipe.next_events(q, until_result=False, stopped=NEVER) == CHUNKS[:2]
    q2 = feed([CHUNKS[0]], gap=0.05)  # nothing queued yet: waits for the first
    assert pipe.next_events(q2, until_result=False, stopped=NEVER, poll=0.001) == [CHUNKS[0]]


def test_job_events_yields_each_chunk_then_the_result_and_ends():
    end = ("result", result("eos"))
    q = feed([*CHUNKS, end, ("chunk", Chunk((9,), "after", None))])
    assert list(pipe.job_events(q, stopped=NEVER, poll=0.001)) == [*CHUNKS, end]


def test_an_error_event_raises_after_the_chunks_before_it():
    q = feed([*CHUNKS[:2], ("error", BadRequest("prompt", "is empty"))])
    got = []
    with pytest.raises(BadRequest, match="prompt: is empty"):
        for event in pipe.job_events(q, stopped=NEVER, poll=0.001):
            got.append(event)
    assert got == CHUNKS[:2]
    q = feed([CHUNKS[0], ("error", ModelError("boom"))], gap=0)
    time.sleep(0.1)
    batch = pipe.next_events(q, until_result=False, stopped=NEVER)
    assert batch[-1][0] == "error"  # a batch ends at the error, returned
    with pytest.raises(ModelError, match="boom"):
        pipe.raise_error(batch)
    assert pipe.raise_error(CHUNKS) == CHUNKS


def test_a_stopped_engine_ends_the_wait():
    q: queue.SimpleQueue = queue.SimpleQueue()
    asked = []

    def stopped() -> bool:
        asked.append(1)
        return len(asked) >= 3

    t0 = time.monotonic()
    with pytest.raises(NotReady, match="the engine stopped"):
        pipe.next_events(q, until_result=True, stopped=stopped, poll=0.01)
    assert len(asked) == 3 and time.monotonic() - t0 < 5


@pytest.mark.parametrize(("reason", "error", "message"), [
    ("deadline", DeadlineExceeded, "deadline exceeded after 3 generated tokens"),
    ("cancelled", Cancelled, "the request was cancelled"),
    ("error", ModelError, "the engine failed on this request"),
])
def test_each_finish_reason_maps_to_its_error(reason, error, message):
    with pytest.raises(error) as info:
        pipe.check_end(result(reason))
    assert str(info.value) == message


def test_the_deadline_in_the_protocols_words_and_errors_left_in_the_answer():
    with pytest.raises(DeadlineExceeded, match="^edgespec.timeout_seconds passed after 5 generated tokens$"):
        pipe.check_end(result("deadline", 5), deadline="edgespec.timeout_seconds passed")
    pipe.check_end(result("error"), failed=False)  # gRPC: FinishReason ERROR in the response
    for reason in ("length", "eos", "stop", "tool_calls"):
        pipe.check_end(result(reason))


def test_request_ids():
    assert pipe.request_id("") == ""
    assert pipe.request_id("a" * 128) == "a" * 128
    assert pipe.request_id("Ab-9_.:x") == "Ab-9_.:x"
    for bad in ("a" * 129, "a b", "请", "٣", "a/b", "a\n"):
        with pytest.raises(BadRequest) as info:
            pipe.request_id(bad, "x-request-id")
        assert info.value.field == "x-request-id"
        assert str(info.value) == "x-request-id: at most 128 characters of [A-Za-z0-9-_.:]"
    with pytest.raises(BadRequest, match="^request_id: "):
        pipe.request_id("a b")


class Loop:
    """What pipe's request checks read of an engine loop."""

    def __init__(self, encoder: object = None, ready: bool = True, capabilities: frozenset[str] = frozenset()):
        self.encoder, self.ready, self.capabilities = encoder, ready, capabilities


CAPABLE = Loop(capabilities=frozenset({"constraint"}))
LIMITS = LimitsConfig(max_constraint_bytes=8)


def test_a_constraint_or_budget_the_engine_cannot_apply_is_refused_by_the_protocols_field():
    json_object = ConstraintSpec("json_object")
    with pytest.raises(BadRequest, match="^response_format: structured output is not available"):
        pipe.check_capabilities(Loop(), LIMITS, constraint=json_object, field="response_format")
    with pytest.raises(BadRequest, match="^reasoning.budget_tokens: a reasoning budget is not available"):
        pipe.check_capabilities(Loop(), LIMITS, constraint=None, field="sampling.constraint", budget=64,
                                budget_field="reasoning.budget_tokens")
    pipe.check_capabilities(Loop(), LIMITS, constraint=None, field="sampling.constraint")  # nothing asked
    pipe.check_capabilities(CAPABLE, LIMITS, constraint=json_object, field="response_format", budget=64)


def test_a_constraints_text_is_held_to_its_limit_naming_the_text_field():
    long = ConstraintSpec("regex", "a" * 9)
    with pytest.raises(BadRequest) as info:
        pipe.check_capabilities(CAPABLE, LIMITS, constraint=long, field="sampling.constraint",
                                value_field="sampling.constraint.value")
    assert str(info.value) == "sampling.constraint.value: at most 8 bytes (limits.max_constraint_bytes), got 9"
    with pytest.raises(BadRequest, match="^edgespec.constraint: at most 8 bytes"):
        pipe.check_capabilities(CAPABLE, LIMITS, constraint=long, field="edgespec.constraint")
    pipe.check_capabilities(CAPABLE, LIMITS, constraint=ConstraintSpec("regex", "a" * 8), field="x")


def test_prompt_tokens_in_the_callers_thread_and_not_ready_without_an_encoder():
    enc = FakeEncoder()
    assert pipe.prompt_tokens(Loop(enc), "", "Hi", ()) == (1, ord("H") % 200 + 20, ord("i") % 200 + 20)
    assert enc.threads == {threading.get_ident()}
    for loop in (Loop(ready=False), Loop()):  # the encoder is set as the engine is built
        with pytest.raises(NotReady, match="still loading"):
            pipe.prompt_tokens(loop, "", "Hi", ())


