"""A streamed answer over HTTP: the jobs' chunks become answer events (answer.py: the text, tool
calls parsed out of it as they come, the reasoning split off, each choice's end, the usage),
which an API's StreamFormat writes as server-sent events. An error once the status line is sent
ends the stream with the format's error event; the client going away cancels every choice."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.responses import StreamingResponse

from edgespec import reasoning
from edgespec import tools as tools_mod
from edgespec.logs import get_logger
from edgespec.server import answer
from edgespec.server import openai_api as oa
from edgespec.server.engine_loop import Job
from edgespec.server.http_errors import error_status
from edgespec.server.http_jobs import HttpJobs, Run
from edgespec.types import Chunk, GenerationResult

log = get_logger("edgespec.server.http_api")

KEEPALIVE_SECONDS = 5.0  # a stream silent this long (queued, or reading a long prompt) sends a keep-alive


def stream_response(jobs: HttpJobs, req: oa.CompletionRequest, run: Run, fmt: answer.StreamFormat,
                    hold: contextlib.ExitStack, headers: dict[str, str]) -> StreamingResponse:
    """The response streaming `run`'s answer in `fmt`; `hold` (the caller's places) closes as it ends."""
    return StreamingResponse(sse(fmt, answer_events(jobs, req, run), run.jobs, hold),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})


def _parsed(events: Sequence[tuple[str, Any]], index: int) -> list[answer.Event]:
    """AnswerStream's ("content", text) and ("call", CallDelta) events as answer events of choice `index`."""
    return [answer.Text(index, v) if kind == "content" else answer.Call(index, v)
            for kind, v in events if kind != "content" or v]


def _content(index: int, text: str, logprobs: Sequence, offset: int,
             parsed: tools_mod.AnswerStream | tools_mod.FormatStream | None) -> list[answer.Event]:
    """A piece of a choice's content as answer events: through the tool-call parser when the
    answer may be calls (text that may still open one held back), else as it is."""
    if parsed is not None:
        return _parsed(parsed.feed(text), index)
    return [answer.Text(index, text, tuple(logprobs), offset)] if text or logprobs else []


async def answer_events(jobs: HttpJobs, req: oa.CompletionRequest, run: Run) -> AsyncIterator[answer.Event]:
    """A stream's answer events (edgespec.server.answer) from its jobs' chunks: the text, with
    tool calls parsed out of it as they come when the request has tools (text that may still
    open a call is held back until it cannot); each choice's End; then the Usage. Waiting
    while nothing came for KEEPALIVE_SECONDS (or at once while queued). A result that did not
    end on its own raises its error."""
    n = len(run.jobs)
    results: list[GenerationResult | None] = [None] * n
    offsets = [0] * n
    answers = [req.tools.stream() if req.parses_calls and req.tools is not None else None for _ in run.jobs]
    splitters = [reasoning.ReasoningSplitter(run.reasoning.opened) if run.reasoning is not None else None
                 for _ in run.jobs]
    batch = run.first
    if batch is None:
        yield answer.Waiting()
        batch = []
    while True:
        for kind, value, i in batch:
            parsed, split = answers[i], splitters[i]
            if kind == "chunk":
                for ev in _chunk(i, value, offsets, parsed, split):
                    yield ev
                continue
            result: GenerationResult = value
            results[i] = result  # what it cost is charged by the engine as it ends
            jobs.check_end(result)
            for ev in _finish(i, result, offsets, parsed, split):
                yield ev
            finish = _finish_reason(result, parsed)
            yield answer.End(i, result, finish, run.jobs[i].timings(), await jobs.stop_sequence(req, result))
        if all(r is not None for r in results):
            break
        batch = await jobs.events(run.events, wait=KEEPALIVE_SECONDS)
        if not batch:
            yield answer.Waiting()
    yield answer.Usage([r for r in results if r is not None], len(run.jobs[0].prompt_tokens or ()))


def _chunk(i: int, c: Chunk, offsets: list[int], parsed: tools_mod.AnswerStream | tools_mod.FormatStream | None,
           split: reasoning.ReasoningSplitter | None) -> list[answer.Event]:
    """Choice i's chunk as answer events: its reasoning, then its content (no logprobs once split)."""
    if split is None:
        out = _content(i, c.text, c.logprobs, offsets[i], parsed)
        offsets[i] += len(c.text)
        return out
    return _split(i, split.feed(c.text), offsets, parsed)


def _split(i: int, parts: Sequence[tuple[str, str]], offsets: list[int],
           parsed: tools_mod.AnswerStream | tools_mod.FormatStream | None) -> list[answer.Event]:
    """ReasoningSplitter's (part, text) pieces of choice i as answer events."""
    out: list[answer.Event] = []
    for part, text in parts:
        out += [answer.Reasoning(i, text)] if part == "reasoning" else _content(i, text, (), offsets[i], parsed)
        offsets[i] += len(text) if part == "content" else 0
    return out


def _finish(i: int, result: GenerationResult, offsets: list[int],
            parsed: tools_mod.AnswerStream | tools_mod.FormatStream | None,
            split: reasoning.ReasoningSplitter | None) -> list[answer.Event]:
    """What choice i's splitter and call parser held back, let out at its end."""
    out = _split(i, split.finish(), offsets, parsed) if split is not None else []
    return out + (_parsed(parsed.finish(), i) if parsed is not None else [])


def _finish_reason(result: GenerationResult, parsed: tools_mod.AnswerStream | tools_mod.FormatStream | None) -> str:
    """The choice's finish reason: "tool_calls" when its answer was calls."""
    finish: str = result.finish_reason
    if parsed is not None and parsed.calls and finish in ("stop", "eos"):
        finish = "tool_calls"
    return finish


async def sse(fmt: answer.StreamFormat, source: AsyncIterator[answer.Event], jobs: Sequence[Job],
              hold: contextlib.ExitStack) -> AsyncIterator[bytes]:
    """A stream's bytes in the API's format. An error ends the stream with the format's error
    event (the status line is sent); the client going away, or the stream breaking, cancels
    every choice's job."""
    done = False
    try:
        if head := fmt.start():
            yield head
        async with contextlib.aclosing(source) as events:  # type: ignore[type-var]
            async for ev in events:
                if data := fmt.event(ev):
                    yield data
        done = True
    except Exception as exc:  # the status line is sent: the error goes in the stream
        done = True
        status, body = error_status(exc)
        if status == 500:
            log.error("http_stream_failed", error=repr(exc), exc_info=exc)
        yield fmt.error(status, body["error"]["message"], body)
    finally:
        for job in jobs:
            if not done or job.finished is None:
                job.cancel()  # the client went away (the generator was closed) or the stream broke
        hold.close()  # the caller's places
    if tail := fmt.end():
        yield tail


__all__: Sequence[str] = ("KEEPALIVE_SECONDS", "answer_events", "sse", "stream_response")
