"""A grammar that fails while its request runs (past llguidance's limits, or its masks past the
step's time budget) fails that request with an error naming the field its constraint came from;
the request beside it in the same ticks ends as usual. The real Engine on the fake backend, in
the real EngineLoop (the HTTP and gRPC APIs map the error: tests/server/test_probes_e2e.py)."""

from __future__ import annotations

import string

import pytest

from edgespec.constraint import Compiler, Vocabulary
from edgespec.errors import BadRequest
from edgespec.sampling import SamplingParams
from edgespec.server import pipe
from edgespec.server.engine_loop import EngineLoop, Job
from edgespec.types import ConstraintSpec, SpeculationParams
from tests import fake_backend

pytest.importorskip("llguidance")

PIECES = [" ", ".", "ab", "ba", "abc", *string.ascii_letters, *string.digits][:fake_backend.VOCAB - 2]


@pytest.fixture
def loop(monkeypatch):
    monkeypatch.setattr(fake_backend, "FakeModel", fake_backend.piece_model(PIECES))
    engine = fake_backend.fake_backed_engine(parallel=2)
    lp = EngineLoop(lambda: engine, parallel=2, queue_size=2).start()
    assert lp.wait_loaded(30)
    yield lp, engine
    lp.stop()


def _events(job: Job) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    try:
        for event in pipe.job_events(job.events, stopped=lambda: False):
            out.append(event)
    except BadRequest as exc:
        out.append(("error", exc))
    return out


def test_a_grammar_failing_mid_run_is_that_requests_error_naming_its_field(loop):
    lp, engine = loop
    matcher = Compiler(Vocabulary.from_model(engine.target)).matcher(ConstraintSpec("regex", "[abc]+"))
    commit = matcher.commit

    def commit_then_too_costly(tokens):  # after the first step's tokens, every step's masks are too costly
        commit(tokens)
        matcher.step_seconds = 0.0

    matcher.commit = commit_then_too_costly
    prompt = tuple(engine.target.tokenize("ab ab", True, False))
    sampling = SamplingParams(max_tokens=12)
    failing = Job(request_id="grammar", sampling=sampling, speculation=SpeculationParams(mode="tree"),
                  prompt_tokens=prompt, constraint=ConstraintSpec("regex", "[abc]+"), matcher=matcher,
                  constraint_field="response_format")
    other = Job(request_id="plain", sampling=sampling, speculation=SpeculationParams(mode="tree"), prompt_tokens=prompt)
    lp.submit(failing)
    lp.submit(other)
    got, beside = _events(failing), _events(other)
    kind, err = got[-1]
    assert kind == "error" and isinstance(err, BadRequest), got
    assert err.field == "response_format" and "token masks took over 0 s" in str(err), str(err)
    assert "failed after" in str(err) and not str(err).startswith("response_format: the constraint failed after 0 ")
    assert beside[-1][0] == "result" and beside[-1][1].finish_reason == "length"
    assert len(beside[-1][1].token_ids) == 12
    assert lp.ready  # the loop goes on
