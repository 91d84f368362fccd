"""Structured output: grammar masks over the target's vocabulary (llguidance), and the pure
functions that apply them to a tree verification without changing the verifier.

llguidance (Rust core, no torch; the grammar engine of llama.cpp, vLLM and SGLang) compiles a
ConstraintSpec -- JSON schema, any JSON object, regex, GBNF or Lark grammar -- for the target's
token bytes; its matcher gives the allowed-token mask at a state, consumes tokens and rolls them
back. The grammar's accept state allows the end-of-generation tokens.

The engine's API:

    compiler = Compiler(Vocabulary.from_model(engine.target))   # once per model (it reads the whole vocabulary)
    matcher = compiler.matcher(req.constraint)                   # per request; BadRequest on a bad grammar
    masks = matcher.node_bits(tree)             # NodeMasks: packed, allowed after each node's path
    res = verify_masked(tree, rows, masks, sampling, rng)        # rows: the target's [n_nodes, n_vocab] logits
    matcher.commit(new_tokens)                  # the accepted path + recovered/bonus token
    matcher.finished                            # nothing but end-of-generation is allowed any more
    matcher.mask_after(path)                    # drafting: allowed after drafted tokens (nothing committed)
    matcher.forced(k)                           # up to k tokens the grammar forces next: free drafts

An engine that applies constraints says so with a `capabilities` attribute holding "constraint";
until then the daemon's APIs refuse constrained requests.

What the mask does to the distribution. Constrained decoding samples from
    p_c(x | ctx) = transform(mask(ctx) ? logits : -inf)        # mask first, then temperature/top_k/top_p/min_p
and speculation must reproduce exactly that. For node i of the tree, ctx is the root's context
plus the tokens on i's path, so row i is masked with the grammar state *after i's path*
(`node_masks`), not its parent's. The verifier (edgespec/verify.py) then runs unchanged on the
masked rows; its draft distribution q must be the one the drafter actually drew from: a drafter
that samples from q masked at the node's state (`mask_q`: q * mask, renormalised; what pays, since
no draft is then wasted on a forbidden token) is verified with the masked q (`masked_tree`);
a drafter that sampled unmasked keeps its q (exact too, lower acceptance). A drafted token the
grammar forbids has p_c = 0 at its parent, so it is always rejected; its own row (and its
subtree's) is never read: `valid[i]` is False there and its mask all False.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance as llg
import numpy as np

from edgespec.errors import BadRequest
from edgespec.sampling import SamplingParams, logits_to_probs
from edgespec.tree import DraftTree
from edgespec.types import ConstraintSpec
from edgespec.verify import VerifyResult, verify_greedy, verify_stochastic

# llguidance's resource limits (its defaults), errors without the grammar's text: a grammar that
# passes them fails its request (Matcher.error), never the engine's tick
LIMITS = llg.LLParserLimits(verbose_errors=False)
# llguidance's grammar checks recurse once per chained rule (about 3 KiB of stack each): a Lark
# chain of 4,400 one-line rules (64 KB) overflows a thread's default 8 MiB stack and kills the
# process. Compiles run on a thread of their own with this much stack (reserved, touched only as used)
COMPILE_STACK_BYTES = 512 << 20
# how much of the engine thread's CPU time grammar masks may take (MaskLimits: limits.constraint_*)
STEP_MASK_SECONDS = 0.5
# a compile thread's nice value above the process's own: a compile (seconds of CPU for a hostile
# grammar, in the caller's handler) yields the cores to the engine's forwards, which decode every
# caller's requests, and takes what they leave
COMPILE_NICE = 10
SPECIAL_PREFIX = b"\xff"  # llguidance's marker for special tokens (never matched by grammar text)


@dataclass(frozen=True)
class MaskLimits:
    """The engine thread's CPU time that grammar masks may take, so that no caller's grammar slows
    the others' decoding at will (the [limits] constraint_* settings).

    One mask past a bound is a grammar too costly to apply: with `parallel` requests in a tick,
    P of them constrained, a tick's masks take at most
        min(P * step_seconds, tick_seconds) + P * (one mask)      # checked between masks
    and a request past its part fails alone (Matcher.failure: a 400 / INVALID_ARGUMENT naming its
    constraint field).

    Over its run a request's masks are paced, not failed: a token bucket of `burst_seconds` that
    fills at `share` of the engine thread's CPU time. A request whose bucket lacks its next step
    (its last step's mask time, at most the burst) sits out ticks (Matcher.waiting: its slot
    held, the others decoding) until the bucket has refilled, so over any E seconds of engine
    time beside others its masks take at most about burst_seconds + share * E (+ one step),
    and it fails only when its deadline passes or it waited `wait_seconds` for one step. Alone
    (no one else to step) it is never held back."""

    step_seconds: float = STEP_MASK_SECONDS  # one request's masks in one decoding step
    tick_seconds: float = 0.5  # every request's masks in one tick: each constrained one gets 1/P of it
    burst_seconds: float = 0.25  # the bucket: one request's masks beyond its share, at most ...
    share: float = 0.25  # ... and the fraction of the engine thread's CPU time it refills at
    wait_seconds: float = 30.0  # the longest (wall-clock) wait for its share before one step: then it fails


@dataclass(frozen=True)
class Vocabulary:
    """What llguidance needs of a tokenizer: every token's bytes, which are special, the
    end-of-generation tokens, and a tokenizer for text (used for grammar literals)."""

    tokens: tuple[bytes, ...]  # [n_vocab]; special tokens as b"\xff" + their text
    special: tuple[int, ...]
    eos: tuple[int, ...]  # end-of-generation tokens: allowed where the grammar accepts
    bos: int | None
    tokenize: Callable[[str], list[int]]

    @classmethod
    def from_model(cls, model: Any) -> Vocabulary:
        """From a backend.Model: `piece` renders special tokens empty, `token_text` names them."""
        tokens, special = [], []
        for t in range(model.n_vocab):
            b = model.piece(t)
            if not b:
                text = model.token_text(t)
                if text:
                    special.append(t)
                    b = SPECIAL_PREFIX + text
            tokens.append(b)
        eos = tuple(t for t in range(model.n_vocab) if model.is_eog(t))
        return cls(tuple(tokens), tuple(special), eos, getattr(model, "bos", None),
                   lambda s: model.tokenize(s, False, False))


class _Wrapped:
    """The duck type llguidance.TokenizerWrapper reads."""

    def __init__(self, v: Vocabulary):
        self.eos_token_id = v.eos[0] if v.eos else len(v.tokens) - 1
        self.bos_token_id = v.bos
        self.tokens = list(v.tokens)
        self.special_token_ids = list(v.special)
        self._tokenize = v.tokenize

    def __call__(self, s: str | bytes) -> list[int]:
        return self._tokenize(s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s)


class Compiler:
    """Compiles constraints for one vocabulary (the tokenizer's token trie is built once)."""

    def __init__(self, vocab: Vocabulary, limits: MaskLimits = MaskLimits()):
        self.vocab = vocab
        self.n_vocab = len(vocab.tokens)
        self.limits = limits
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped(vocab)), eos_token=list(vocab.eos) or None)
        self._stack_lock = threading.Lock()

    def grammar(self, spec: ConstraintSpec) -> str:
        """The llguidance grammar for `spec`; BadRequest("constraint.value") if it does not compile."""
        try:
            if spec.kind == "json_schema":
                schema = json.loads(spec.value)
                if not isinstance(schema, (dict, bool)):
                    raise BadRequest("constraint.value", "a JSON schema must be an object")
                g = llg.LLMatcher.grammar_from_json_schema(spec.value, defaults={"whitespace_flexible": False})
            elif spec.kind == "json_object":
                g = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                           defaults={"whitespace_flexible": False})
            elif spec.kind == "regex":
                g = llg.LLMatcher.grammar_from_regex(spec.value)
            elif spec.kind == "grammar":
                g = llg.grammar_from("gbnf", spec.value)
            else:
                g = llg.LLMatcher.grammar_from_lark(spec.value)
        except BadRequest:
            raise
        except ValueError as exc:
            raise BadRequest("constraint.value", f"invalid {spec.kind}: {_first_line(str(exc))}") from None
        err = llg.LLMatcher.validate_grammar(g, self.tokenizer)
        if err and not err.startswith("WARNING"):
            raise BadRequest("constraint.value", f"invalid {spec.kind}: {_first_line(err)}")
        return g

    def matcher(self, spec: ConstraintSpec) -> Matcher:
        """A request's grammar state, its first mask computed in the caller's thread (on a
        large-stack thread of its own: COMPILE_STACK_BYTES): that builds the lexer's first states,
        which for a grammar like `(a{1000}){1000}` takes seconds or passes llguidance's limits.
        BadRequest("constraint.value") when it does. The request's reasoning budget is not
        applied here: edgespec.budget.matcher wraps this one in it."""
        return self._on_large_stack(lambda: self._matcher(spec))

    def _on_large_stack(self, fn: Callable[[], Any]) -> Any:
        """fn() on a thread with COMPILE_STACK_BYTES of stack (the setting applies to threads
        started while it holds, hence the lock); its exception re-raised here."""
        out: dict[str, Any] = {}

        def run() -> None:
            _lower_priority(COMPILE_NICE)
            try:
                out["value"] = fn()
            except BaseException as exc:
                out["error"] = exc

        with self._stack_lock:
            before = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                worker = threading.Thread(target=run, name="edgespec-grammar", daemon=True)
                worker.start()
            finally:
                threading.stack_size(before)
        worker.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    def _matcher(self, spec: ConstraintSpec) -> Matcher:
        m = Matcher(llg.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0, limits=LIMITS), self.n_vocab,
                    tuple(self.vocab.eos), limits=self.limits)
        m.bitmask()
        m.spent = m.total = 0.0  # the first mask is the caller's, not the engine's
        if m.error is not None:
            raise BadRequest("constraint.value", f"{spec.kind} is too complex for the grammar engine's limits: "
                             f"{m.error}")
        return m


def _lower_priority(by: int) -> None:
    """This thread's CPU priority lowered by `by` nice levels (Linux gives each thread its own
    nice value; elsewhere, or where it is refused, nothing changes)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (AttributeError, OSError):
        pass


def _first_line(s: str) -> str:
    return " ".join(s.strip().splitlines()[:3])[:500]


class Matcher:
    """One request's grammar state: masks at the state and after hypothetical paths (a tree's),
    and the commit of emitted tokens. Engine thread only.

    A grammar can pass llguidance's limits while the request runs (its lexer building too many
    states after some text), or its masks can take more of the engine thread than `limits`
    allow in one step (a step's bound, its share of a tick's): the matcher then records `error`
    (`failure`) and allows only end-of-generation tokens, so that the tick serving the others goes
    on, and the engine fails that one request with the reason. Over its run its masks are paced by
    a token bucket (`waiting`: the schedule holds the request out of ticks until its share has
    refilled; `defer` counts the ticks it sat out)."""

    def __init__(self, m: Any, n_vocab: int, eos: Sequence[int] = (), limits: MaskLimits = MaskLimits()):
        self._m = m
        self.n_vocab = n_vocab
        self._words = (n_vocab + 31) // 32
        self.eos = tuple(eos)
        self.error: str | None = None  # the first line of llguidance's error, once it failed
        self.limits = limits
        self.step_seconds = limits.step_seconds  # this request's bound for one step
        self.tick_seconds = math.inf  # its share of the tick under way (`allow`)
        self.spent = 0.0  # seconds of mask computation in the step under way (node_bits ends it)
        self.total = 0.0  # seconds of mask computation in all its steps
        self.deferred = 0  # ticks it sat out waiting for its share (`defer`)
        self._level = limits.burst_seconds  # the bucket: mask seconds it may take now (as of _clock)
        self._clock: float | None = None  # the engine thread's CPU clock at the bucket's last update
        self._last_step = 0.0  # mask seconds of its last tick: what its next step is expected to take
        self._step_from = 0.0  # `total` as its current tick began
        self._waiting_since: float | None = None  # monotonic time it was first held for the step to come

    def allow(self, constrained: int) -> None:
        """A tick begins with `constrained` requests under a grammar, this one among them stepping:
        its masks may take its equal part of the tick's mask time (limits.tick_seconds)."""
        self.tick_seconds = self.limits.tick_seconds / max(1, constrained)
        if self._clock is None:
            self._clock = time.thread_time()
        self._last_step, self._step_from = self.total - self._step_from, self.total
        self._waiting_since = None

    def level(self, now: float | None = None) -> float:
        """The bucket at engine-thread CPU time `now` (default: this thread's clock now): refilled at
        limits.share of the time since its last update, at most limits.burst_seconds; at least
        -limits.step_seconds (the debt of steps taken while no one else could step)."""
        lim = self.limits
        if self._clock is None:
            return self._level
        now = time.thread_time() if now is None else now
        return max(-lim.step_seconds, min(lim.burst_seconds, self._level + lim.share * (now - self._clock)))

    def waiting(self) -> bool:
        """Whether its bucket lacks its next step (the last one's mask time, at most the burst):
        the schedule then holds it out of the tick when another request can step. Asks only (on
        the engine thread, whose CPU clock fills the bucket)."""
        if self.error is not None or self._clock is None:
            return False
        return self.level() < min(self._last_step, self.limits.burst_seconds)

    def defer(self) -> None:
        """The tick goes on without it (`waiting`). Past limits.wait_seconds of waiting for one
        step it fails: its next step allows only end-of-generation."""
        now = time.monotonic()
        self.deferred += 1
        if self._waiting_since is None:
            self._waiting_since = now
        elif now - self._waiting_since > self.limits.wait_seconds and self.error is None:
            self.error = (f"its token masks waited over {self.limits.wait_seconds:g} s for their share of "
                          f"the engine (the grammar is too costly to apply beside the other requests)")

    @property
    def failure(self) -> str | None:
        """Why the grammar can no longer be applied (past llguidance's limits or the step's time),
        or None."""
        return self.error if self._failed() else None

    def _over_budget(self) -> bool:
        if self.error is not None:
            return True
        limit = min(self.step_seconds, self.tick_seconds)
        if self.spent > limit:
            shared = " (its share of the tick, beside other constrained requests)" if limit < self.step_seconds else ""
            self.error = (f"its token masks took over {limit:g} s of one decoding step{shared} "
                          f"(the grammar is too costly to apply)")
        return self.error is not None

    def _failed(self) -> bool:
        if self.error is None and self._m.is_error():
            self.error = _first_line(self._m.get_error())[:200]
        return self.error is not None

    def _eos_bits(self, out: np.ndarray) -> None:
        out[:] = 0
        for t in self.eos:
            out[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def _bits(self, out: np.ndarray) -> None:
        if self._failed():
            self._eos_bits(out)
            return
        t0 = time.thread_time()  # this thread's CPU time: a busy host's preemption is not the grammar's
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        t1 = time.thread_time()
        dt = t1 - t0
        self.spent += dt
        self.total += dt
        if self._clock is not None:  # the bucket pays for it (masks before its first tick are the compile's)
            self._level = max(-self.limits.step_seconds, self.level(t1) - dt)
            self._clock = t1
        if self._failed():
            self._eos_bits(out)

    def mask(self) -> np.ndarray:
        """[n_vocab] bool: the tokens allowed at the current state."""
        bits = np.zeros(self._words, dtype=np.int32)
        self._bits(bits)
        return unpack_bitmask(bits, self.n_vocab)

    def bitmask(self) -> np.ndarray:
        """[ceil(n_vocab / 32)] int32, bit t % 32 of word t // 32 set when token t is allowed."""
        bits = np.zeros(self._words, dtype=np.int32)
        self._bits(bits)
        return bits

    def node_bits(self, tree: DraftTree) -> NodeMasks:
        """The tokens allowed after the tokens on each node's path (root excluded: the root is
        already committed), packed. A node whose path the grammar forbids is not valid and its
        mask is empty. Nothing is committed: a depth-first walk consumes each node's token on the
        way down and rolls it back on the way up, one mask computation per valid node."""
        n = len(tree)
        bits = np.zeros((n, self._words), dtype=np.int32)
        valid = np.zeros(n, dtype=bool)
        children = tree.children()
        m = self._m
        self._bits(bits[0])
        valid[0] = True

        def visit(node: int) -> None:
            for c in children[node]:
                if self._over_budget():
                    return
                if m.try_consume_tokens([tree.tokens[c]]) != 1:
                    continue
                valid[c] = True
                self._bits(bits[c])
                if children[c]:
                    visit(c)
                m.rollback(1)

        if not self._failed():
            visit(0)
        self._over_budget()
        self.spent = 0.0  # the step's masks are done
        if self._failed():  # past llguidance's limits or the step's time: the request may only end
            bits[:] = 0
            self._eos_bits(bits[0])
            valid[1:] = False
        return NodeMasks(bits, valid, self.n_vocab)

    def node_masks(self, tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
        """(masks [n, n_vocab] bool, valid [n] bool): node_bits unpacked."""
        nm = self.node_bits(tree)
        return nm.dense(), nm.valid

    def mask_after(self, path: Sequence[int]) -> np.ndarray:
        """[n_vocab] bool: the tokens allowed after `path` (tokens not committed: a drafted branch),
        all False when the grammar forbids the path itself. Nothing is committed."""
        toks = [int(t) for t in path]
        if self._over_budget():  # this step's masks are spent: nothing more is drafted
            return np.zeros(self.n_vocab, dtype=bool)
        m = self._m
        n = m.try_consume_tokens(toks) if toks else 0
        try:
            if n != len(toks):
                return np.zeros(self.n_vocab, dtype=bool)
            return self.mask()
        finally:
            if n:
                m.rollback(n)

    def forced(self, limit: int) -> list[int]:
        """At most `limit` tokens the grammar forces after the current state (the only ones it
        allows, in llguidance's canonical tokenization); nothing is committed."""
        if self._failed():
            return []
        return [int(t) for t in self._m.compute_ff_tokens()[:limit]]

    def allows(self, tokens: Sequence[int]) -> bool:
        """Whether the tokens can be committed in order from the current state."""
        return self._m.validate_tokens(list(tokens)) == len(tokens)

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance the state by the emitted tokens (they were drawn from masked rows, so they are
        allowed; anything else is a bug in the caller)."""
        toks = [int(t) for t in tokens]
        if not toks or self._failed():  # a failed grammar's request ends with what it has
            return
        if self._m.try_consume_tokens(toks) != len(toks):
            raise RuntimeError(f"grammar: tokens {toks} are not allowed at this state")

    def reset(self) -> None:
        self._m.reset()

    @property
    def finished(self) -> bool:
        """Nothing but an end-of-generation token may follow."""
        return self._failed() or bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        """The text so far satisfies the grammar (end-of-generation allowed now)."""
        return self._failed() or bool(self._m.is_accepting())


# ---- pure functions over masks -----------------------------------------------------------------


@dataclass(frozen=True)
class NodeMasks:
    """A tree's grammar masks, packed: bit t % 32 of bits[i, t // 32] is set when token t may follow
    node i's path. A row is unpacked only when the verifier reads it. A node with an empty mask (a
    forbidden path, or one after end-of-generation) is never sampled from: the verifier walks only
    accepted nodes and generation ends at end-of-generation; its row is read unmasked, which keeps
    the arithmetic finite."""

    bits: np.ndarray  # [n_nodes, ceil(n_vocab / 32)] int32
    valid: np.ndarray  # [n_nodes] bool: the grammar allows the node's path
    n_vocab: int

    @classmethod
    def from_bools(cls, masks: np.ndarray) -> NodeMasks:
        masks = np.asarray(masks, dtype=bool)
        n, v = masks.shape
        packed = np.packbits(masks, axis=1, bitorder="little")
        words = (v + 31) // 32
        buf = np.zeros((n, words * 4), dtype=np.uint8)
        buf[:, : packed.shape[1]] = packed
        return cls(buf.view(np.int32), np.asarray(masks.any(axis=1)), v)

    def __len__(self) -> int:
        return len(self.bits)

    def empty(self, i: int) -> bool:
        return not self.bits[i].any()

    def allows(self, i: int, token: int) -> bool:
        """Token `token` may follow node i (True for an empty mask: see the class)."""
        return bool((int(self.bits[i, token >> 5]) >> (token & 31)) & 1) or self.empty(i)

    def row(self, i: int) -> np.ndarray:
        """[n_vocab] bool: node i's mask (all True for an empty one)."""
        if self.empty(i):
            return np.ones(self.n_vocab, dtype=bool)
        return unpack_bitmask(self.bits[i], self.n_vocab)

    def dense(self) -> np.ndarray:
        """[n_nodes, n_vocab] bool, empty masks kept empty."""
        return unpack_bitmask(self.bits, self.n_vocab)


def apply_mask(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """logits with -inf where the mask forbids ([..., n_vocab], same shape; a new array)."""
    return np.where(mask, logits, -np.inf)


def unpack_bitmask(bits: np.ndarray, n_vocab: int) -> np.ndarray:
    """Matcher.bitmask() -> [n_vocab] bool."""
    return np.unpackbits(np.asarray(bits, dtype=np.int32).view(np.uint8), axis=-1,
                         bitorder="little")[..., :n_vocab].astype(bool)


def mask_q(q: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The draft distribution restricted to what the grammar allows, renormalised (zeros when
    the draft has no mass there: a drafter then proposes nothing from it)."""
    out = np.where(mask, q, 0.0).astype(np.float64)
    s = out.sum()
    return out / s if s > 0 else out


def masked_tree(tree: DraftTree, masks: NodeMasks | np.ndarray) -> DraftTree:
    """A copy of the tree whose draft distributions are masked at each node's state (mask_q): the
    q to verify with when the drafter sampled from masked q."""
    row = masks.row if isinstance(masks, NodeMasks) else masks.__getitem__
    qs = [None if q is None else mask_q(q, row(i)) for i, q in enumerate(tree.q)]
    return dataclasses.replace(tree, tokens=list(tree.tokens), parents=list(tree.parents), depths=list(tree.depths),
                               point=list(tree.point), q=qs)


def verify_masked(tree: DraftTree, rows: np.ndarray, masks: NodeMasks | np.ndarray, sampling: SamplingParams,
                  rng: np.random.Generator, *, q_masked: bool = True) -> VerifyResult:
    """Verify a tree under a constraint: row i ([n, n_vocab] target logits) masked by mask i (the
    state after node i's path; NodeMasks, or [n, n_vocab] bool), then the usual verifier. Greedy:
    the argmax of each masked row (the row's own argmax when the grammar allows it: no row is
    unpacked then). Stochastic: the transformed masked rows, each masked when the verifier reads it,
    and the tree's q masked too when the drafter sampled from masked q (`q_masked`)."""
    if not isinstance(masks, NodeMasks):
        masks = NodeMasks.from_bools(masks)
    if sampling.greedy:
        top = np.argmax(rows, axis=1)
        for i, t in enumerate(top):
            if not masks.allows(i, int(t)):
                top[i] = int(np.argmax(apply_mask(rows[i], masks.row(i))))
        return verify_greedy(tree, top)
    t = masked_tree(tree, masks) if q_masked else tree
    return verify_stochastic(t, lambda i: logits_to_probs(apply_mask(rows[i], masks.row(i)), sampling), rng)


def masked_rows(rows: np.ndarray, masks: NodeMasks) -> np.ndarray:
    """[n, n_vocab] logits with -inf where each node's mask forbids (empty masks: the row as it is):
    the distributions the verifier sampled from, for logprobs."""
    return np.stack([apply_mask(rows[i], masks.row(i)) for i in range(len(masks))]) if len(masks) else rows
