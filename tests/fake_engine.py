"""The tests' one fake engine: the whole engine_loop.LoopEngine (tests/server/test_loop_engine.py
checks it) and bench.runner.BenchEngine, with no llama.cpp and no model. Deterministic, with a
configurable step time so cancel/deadline/overload can be exercised quickly; it records the
threads that call it so tests can assert the one-engine-thread rule, and every request it gets.

The real Engine over a fake llama.cpp (tests/fake_backend.py) is what tests of the tick, the
session and the KV bookkeeping use; this one is for what sits around an engine: the loop, the
daemon, the HTTP and gRPC APIs, the bench."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

from edgespec import chat
from edgespec.drafters.suffix import SuffixCache
from edgespec.errors import BadRequest, ForwardAborted, Overloaded
from edgespec.types import Chunk, FinishReason, GenerationRequest, GenerationResult, SpecStats, TokenLogprob

WORDS = ("alpha ", "beta ", "gamma ", "delta ")
# generate(): mode -> (tokens per target forward, seconds per target forward)
SHAPES = {"plain": (1, 0.010), "chain": (2, 0.012), "tree": (4, 0.016), "auto": (3, 0.012)}
N_VOCAB = 256


def _tokenize(text: str, add_special: bool) -> list[int]:
    return ([1] if add_special else []) + [ord(c) % 200 + 20 for c in text]


def _chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    return "".join(f"<{role}>{content}\n" for role, content in messages) + "<assistant>"


class FakeSession:
    breaker_state: str | None = None  # no breaker: these sessions never run auto speculation

    def __init__(self, engine: FakeEngine, req: GenerationRequest):
        self.engine, self.req = engine, req
        self.out: list[int] = []
        self.text = ""
        self.finish_reason: FinishReason | None = None
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
            self.finish_reason = cast("FinishReason", reason or "cancelled")
        if not self.closed:
            self.closed = True
            self.engine.busy -= 1
            self.engine.idle_left = self.engine.idle_pieces_per_request  # a context to absorb


class FakeEncoder:
    """The target's vocabulary and chat template (Engine.encoder, a backend.Model): used by the
    daemon's handler threads, so it records its own callers' threads, apart from the engine's."""

    special_tokens: Mapping[str, int] = {}  # none: every text is text
    n_vocab = N_VOCAB

    def __init__(self) -> None:
        self.threads: set[int] = set()
        self.calls = 0

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self.threads.add(threading.get_ident())
        self.calls += 1
        return _tokenize(text, add_special)

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> str:
        self.threads.add(threading.get_ident())
        return _chat_prompt(messages)

    def piece(self, token: int) -> bytes:
        return chr(token).encode()

    def detokenize(self, tokens: Sequence[int]) -> str:
        return "".join(chr(t) for t in tokens)


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
        self.target = FakeEncoder()  # the model whose vocabulary and chat template `encoder` is
        self.tick_totals: Mapping[str, float] = {}  # none: this engine has no tick phases
        # the cross-request suffix cache, as Engine's: on, empty (these sessions never feed it)
        self.suffix_cache = SuffixCache(1 << 20)
        self.suffix_enabled = True
        self._aborted = threading.Event()  # abort_forward's flag, lowered as a tick starts
        self.aborts = 0  # abort_forward's calls
        self.suffix_calls: list[tuple[bool | None, bool]] = []  # suffix_control's (enabled, clear)
        self.tokenized: list[tuple[bool, bool]] = []  # tokenize's (add_special, parse_special), in order
        self.answer = '{"name": "Ann", "age": 3}'  # generate(): the text of a constrained answer
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

    @property
    def encoder(self) -> FakeEncoder:
        """Engine.encoder: the target's vocabulary and chat template, for the handler threads."""
        return self.target

    def suffix_control(self, enabled: bool | None = None, clear: bool = False) -> dict[str, Any]:
        """Engine.suffix_control, every call recorded: the cache on or off (off empties it) and/or
        emptied; its stats."""
        self.suffix_calls.append((enabled, clear))
        if enabled is not None:
            self.suffix_enabled = bool(enabled)
        if clear or not self.suffix_enabled:
            self.suffix_cache.clear()
        return self.suffix_stats()

    def suffix_stats(self) -> dict[str, Any]:
        return {"enabled": self.suffix_enabled, **self.suffix_cache.stats()}

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
        self.tokenized.append((add_special, parse_special))
        return _tokenize(text, add_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> str:
        self._touch()
        return _chat_prompt(messages)

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        self._touch()
        return chat.encode_chat(self.encoder, messages)

    def model_info(self) -> dict:
        self._touch()
        return {"target": {"path": "/fake/target.gguf", "n_params": 1}, "draft": {"path": "/fake/draft.gguf"},
                "n_vocab": N_VOCAB, "n_ctx": self.n_ctx, "parallel": self.parallel, "backend": "cpu"}

    def tick(self, sessions: Sequence[Any]) -> dict[Any, Chunk]:
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

    def generate(self, req: GenerationRequest) -> GenerationResult:
        """Engine.generate, as the bench calls it: deterministic stats per mode (SHAPES), every
        step accepting all its drafts; each forward 10 ms of target time, the rest drafting."""
        self._touch()
        self.requests.append(req)
        n = req.sampling.max_tokens
        per_forward, seconds = SHAPES[req.speculation.mode]
        forwards = -(-n // per_forward)
        stats = SpecStats(target_forwards=forwards, emitted_tokens=n, seconds=forwards * seconds,
                          target_seconds=forwards * 0.010, draft_seconds=forwards * (seconds - 0.010),
                          draft_forwards=forwards * (per_forward - 1),
                          accepted_per_depth=[forwards] * (per_forward - 1))
        return GenerationResult(text=self.answer if req.constraint else "x" * n, token_ids=[0] * n,
                                finish_reason="length", prompt_tokens=len(req.prompt_tokens), stats=stats)
