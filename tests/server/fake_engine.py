"""A fake engine with the real Engine's API: no llama.cpp, deterministic, with a configurable
step time so cancel/deadline/overload can be exercised quickly. It records the threads that
call it so tests can assert the one-engine-thread rule."""

from __future__ import annotations

import threading
import time
from typing import Any

from edgespec import chat
from edgespec.drafters.suffix import SuffixCache
from edgespec.errors import BadRequest, ForwardAborted, Overloaded
from edgespec.types import Chunk, GenerationRequest, GenerationResult, SpecStats, TokenLogprob

WORDS = ("alpha ", "beta ", "gamma ", "delta ")


class FakeSession:
    breaker_state: str | None = None  # no breaker: these sessions never run auto speculation

    def __init__(self, engine: FakeEngine, req: GenerationRequest):
        self.engine, self.req = engine, req
        self.out: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stats = SpecStats()
        self.closed = False
        self.logprobs: list[TokenLogprob] = []
        seed = req.sampling.seed
        # engine.seeded: a seed picks where in the words the answer starts and how long it is
        self.shift = seed % len(engine.words) if engine.seeded and seed is not None else 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def step(self) -> Chunk:
        self.engine._touch()
        if self.engine.fail_on_step:
            raise RuntimeError("boom")
        if self.engine._aborted.wait(self.engine.step_seconds):  # abort_forward: the step's "forward" stops
            raise ForwardAborted("the forward was aborted")
        # a "tree" accepts two tokens on odd steps, one on even ones
        n = 2 if self.stats.target_forwards % 2 else 1
        n = min(n, self.req.sampling.max_tokens - len(self.out))
        new = [(len(self.out) + i + self.shift) % len(self.engine.words) + 10 for i in range(n)]
        self.out += new
        piece = "".join(self.engine.words[t - 10] for t in new)
        self.text += piece
        self.stats.target_forwards += 1
        self.stats.target_seconds += 0.004  # time "inside" the forwards: 4 ms target, 1 ms draft per step
        self.stats.draft_seconds += 0.001
        self.stats.drafted_tokens += 3
        self.stats.accepted_tokens += n - 1
        self.stats.emitted_tokens += n
        mode = self.req.speculation.mode
        self.stats.steps_per_mode[mode] = self.stats.steps_per_mode.get(mode, 0) + 1
        if n > 1:
            self.stats.accepted_per_depth = [self.stats.accepted_tokens]
        if len(self.out) >= self.req.sampling.max_tokens:
            self.finish_reason = "length"
        if self.engine.eos_after is not None and len(self.out) >= self.engine.eos_after + self.shift:
            self.finish_reason = "eos"
        lps: tuple[TokenLogprob, ...] = ()
        if self.req.logprobs is not None:  # token t: logprob -t/100, alternatives 0..k-1 at -5 - j
            lps = tuple(TokenLogprob(t, -t / 100, tuple((j, -5.0 - j) for j in range(self.req.logprobs))) for t in new)
            self.logprobs += lps
        return Chunk(tuple(new), piece, self.finish_reason, logprobs=lps)

    def result(self) -> GenerationResult:
        return GenerationResult(self.text, list(self.out), self.finish_reason or "length",
                                len(self.req.prompt_tokens), self.stats, logprobs=list(self.logprobs))

    def close(self, reason: str | None = None) -> None:
        self.engine._touch()
        if self.finish_reason is None:
            self.finish_reason = reason or "cancelled"
        if not self.closed:
            self.closed = True
            self.engine.busy -= 1
            self.engine.idle_left = self.engine.idle_pieces_per_request  # a context to absorb


class FakeEncoder:
    """The engine's thread-safe tokenizer and chat template (Engine.encoder): used by the daemon's
    handler threads, so it records its own callers' threads, apart from the engine's."""

    special_tokens: dict[str, int] = {}  # none: every text is text

    def __init__(self) -> None:
        self.threads: set[int] = set()
        self.calls = 0

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self.threads.add(threading.get_ident())
        self.calls += 1
        return ([1] if add_special else []) + [ord(c) % 200 + 20 for c in text]

    def chat_prompt(self, messages: list[tuple[str, str]]) -> str:
        self.threads.add(threading.get_ident())
        return "".join(f"<{role}>{content}\n" for role, content in messages) + "<assistant>"


class FakeEngine:
    capabilities = frozenset({"constraint"})  # constraints are only recorded
    special_tokens: dict[str, int] = {}  # none (with tokenize and chat_prompt: a chat.ChatTokenizer)

    def __init__(self, parallel: int = 2, n_ctx: int = 256, step_seconds: float = 0.01, load_seconds: float = 0.0):
        self.parallel = parallel
        self.n_ctx = n_ctx
        self.step_seconds = step_seconds
        self.busy = 0
        self.threads: set[int] = set()
        self.requests: list[GenerationRequest] = []
        self.fail_on_step = False
        self.closed = False
        # idle work (Engine.idle_work): each finished request leaves this many pieces of it
        self.idle_pieces_per_request = 0
        self.idle_seconds = 0.0  # per piece
        self.idle_left = 0
        self.idle_calls = 0
        self.fail_idle = False
        self.idle_aborts: list[bool] = []  # abort_idle_work's calls, in order
        self._idle_stop = threading.Event()
        self.in_piece = False  # a piece of idle work is under way
        self.encoder = FakeEncoder()
        self.tick_totals: dict[str, float] = {}
        self.suffix_cache = SuffixCache()  # never filled: these sessions draft nothing from it
        self._aborted = threading.Event()  # abort_forward's flag, lowered as a tick starts
        self.aborts = 0  # abort_forward's calls
        self.suffix_calls: list[tuple[bool | None, bool]] = []  # suffix_control's (enabled, clear)
        self.words = WORDS  # what tokens 10, 11, ... render as (a test may make them a tool call)
        self.seeded = False  # a request's seed shifts its answer (see FakeSession)
        self.eos_after: int | None = None  # end of sequence after this many tokens
        time.sleep(load_seconds)
        self._touch()

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())

    def abort_forward(self) -> None:  # any thread, as Engine.abort_forward
        self.aborts += 1
        self._aborted.set()

    def suffix_stats(self) -> dict:
        """Engine.suffix_stats: no figures (the cache is never filled)."""
        return {}

    def suffix_control(self, enabled: bool | None = None, clear: bool = False) -> dict:
        """Engine.suffix_control: this engine has no suffix cache, so the calls are only recorded."""
        self.suffix_calls.append((enabled, clear))
        return {}

    def compile_constraint(self, spec: Any) -> tuple[str, Any, int]:
        """Engine.compile_constraint, from any thread: a stand-in grammar state naming the spec and
        the thread that compiled it; a regex "(" does not compile."""
        if spec.kind == "regex" and spec.value == "(":
            raise BadRequest("constraint.value", "invalid regex: unbalanced parenthesis")
        return ("matcher", spec, threading.get_ident())

    def warmup(self) -> None:
        self._touch()

    def idle_work(self) -> bool:
        self._touch()
        self.idle_calls += 1
        if self.fail_idle:
            raise RuntimeError("idle work failed")
        if self.idle_left <= 0:
            return False
        self.in_piece = True
        try:
            if self._idle_stop.wait(self.idle_seconds):  # stopped by an arriving job: the piece is undone
                return False
        finally:
            self.in_piece = False
        self.idle_left -= 1
        return self.idle_left > 0

    def abort_idle_work(self, on: bool = True) -> None:  # any thread, as Engine.abort_idle_work
        self.idle_aborts.append(on)
        self._idle_stop.set() if on else self._idle_stop.clear()

    def close(self) -> None:
        self._touch()
        self.closed = True

    @property
    def free_slots(self) -> int:
        return self.parallel - self.busy

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self._touch()
        return ([1] if add_special else []) + [ord(c) % 200 + 20 for c in text]

    def detokenize(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def chat_prompt(self, messages: list[tuple[str, str]]) -> str:
        self._touch()
        return "".join(f"<{role}>{content}\n" for role, content in messages) + "<assistant>"

    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        self._touch()
        return chat.encode_chat(self.encoder, messages)

    def model_info(self) -> dict:
        self._touch()
        return {"target": {"path": "/fake/target.gguf", "n_params": 1}, "draft": {"path": "/fake/draft.gguf"},
                "n_vocab": 256, "n_ctx": self.n_ctx, "parallel": self.parallel, "backend": "cpu"}

    def tick(self, sessions: list) -> dict:
        """One engine tick: every session one step (the real engine batches them)."""
        self._aborted.clear()
        return {s: s.step() for s in sessions}

    def open_session(self, req: GenerationRequest) -> FakeSession:
        self._touch()
        if not req.prompt_tokens:
            raise BadRequest("prompt", "is empty")
        if len(req.prompt_tokens) + req.sampling.max_tokens > self.n_ctx:
            raise BadRequest("prompt", f"{len(req.prompt_tokens)} prompt tokens + max_tokens "
                                       f"{req.sampling.max_tokens} exceed the context ({self.n_ctx} tokens)")
        if self.busy >= self.parallel:
            raise Overloaded("all slots busy")
        self.busy += 1
        self.requests.append(req)
        return FakeSession(self, req)
