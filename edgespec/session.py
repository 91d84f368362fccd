"""One request on one slot: its context, drafters, controller, and the per-step pieces the tick
(edgespec/tick/) calls. Not thread-safe: driven by the engine thread. What a step does lives in
the tick's modules: the step record and its stats (tick/step.py), grafts (tick/graft.py), the
tree's KV layout and commit (tick/layout.py), verification (tick/verdict.py). Its parts
(drafter, prompt lookups, suffix view, controller) are built by edgespec/session_parts.py; the
engine it asks for ticks and its release is a `SessionHost`, not imported.

A session's context is `tokens` = prompt + emitted. Invariant between ticks once the prefill is
done: the slot's main sequence (local seq 0 of its range) holds exactly tokens[:-1]; tokens[-1]
(the root) is decoded by the next tick together with the drafted tree. Before that, the prompt
is prefilled in pieces (`prefill_pos` tokens are in the cache), one piece per tick.

What a session is doing is its `state` (SessionState), as llama.cpp's server_slot says of a slot:
PREFILLING -> READY -> STEPPING -> VERIFIED -> READY ... -> CLOSED; ABANDONED when a forward of
its tick was aborted (it is then closed). The tick (tick/schedule.py) reads it to sort sessions
into those reading their prompt and those decoding; the slot pool (slots.py) reads it to know
whether the caches hold what the invariants say when the session ends.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from edgespec import session_parts
from edgespec.controller import Decision
from edgespec.emit import Emitter
from edgespec.errors import BadRequest
from edgespec.logprobs import token_logprob
from edgespec.logs import get_logger
from edgespec.penalties import Adjuster, adjusts
from edgespec.session_parts import PartsHost
from edgespec.shape import PLAIN, Shape, chain, eagle
from edgespec.tick import graft, layout, verdict
from edgespec.tick.step import Batch, StepRecord, count_verified, outcome
from edgespec.tree import DraftTree
from edgespec.types import (
    Chunk,
    ConstraintSpec,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SpecStats,
    TokenLogprob,
)

if TYPE_CHECKING:
    from edgespec.budget import BudgetMatcher
    from edgespec.constraint import Matcher
    from edgespec.controller import CostModel
    from edgespec.drafters.base import DraftReport, DraftSteps
    from edgespec.slots import Slot

log = get_logger("edgespec.session")

# explicit-mode tree defaults beyond the request's (depth, nodes): EAGLE-2 top-4 branching,
# two frontier nodes expanded per level
TREE_WIDTH = 4
TREE_EXPAND = 2


def fixed_shape(mode: str, draft_tokens: int, tree_nodes: int, tree_depth: int) -> Shape:
    if mode == "plain":
        return PLAIN
    if mode == "chain":
        return chain(draft_tokens)
    return eagle(tree_depth, TREE_WIDTH, TREE_EXPAND, tree_nodes)


class SessionState(enum.Enum):
    """What a session is doing (Session.state)."""

    PREFILLING = "prefilling"  # reading its prompt in pieces: seq 0 holds prompt[:prefill_pos]
    READY = "ready"  # between steps: seq 0 holds tokens[:-1], nothing else survives
    STEPPING = "stepping"  # a step begun (begin_step): its tree's cells are not committed yet
    VERIFIED = "verified"  # the step committed and emitted; its tick's observe is to come
    ABANDONED = "abandoned"  # a forward of its tick was aborted: llama.cpp dropped part of its cells
    CLOSED = "closed"  # ended (Session.close): the slot kept what was reusable, or nothing


# the states in which the slot's caches are as the invariants say (a session ending in one of
# them leaves its slot something reusable)
CONSISTENT = frozenset({SessionState.PREFILLING, SessionState.READY, SessionState.VERIFIED})


class SessionHost(PartsHost, Protocol):
    """What a session reads of the engine that hosts it (edgespec/engine.py: Engine): what its
    parts are built from (session_parts.PartsHost), whether slots keep prompts, the grammar
    compiler, and the tick and the release a session asks of it."""

    @property
    def prompt_cache(self) -> bool: ...

    def constraint_matcher(self, spec: ConstraintSpec) -> Matcher | BudgetMatcher: ...
    def tick(self, sessions: Sequence[Session]) -> dict[Session, Chunk]: ...
    def release(self, sess: Session) -> None: ...


class Session:
    def __init__(self, engine: SessionHost, slot: Slot, req: GenerationRequest, keep: int = 0, drafter: str | None = None):
        """`keep`: leading prompt positions whose KV the slot's main sequence already holds
        (the prompt cache); the rest of the prompt is prefilled by the ticks. `drafter`: the
        drafter kind it drafts with ("model", "eagle3"; default the engine's draft)."""
        self.engine = engine
        self.slot = slot
        self.req = req
        self.sampling = req.sampling
        self.spec = req.speculation
        seed = req.sampling.seed if req.sampling.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.rng = np.random.default_rng(seed)
        self.tokens: list[int] = list(req.prompt_tokens)
        self.n_prompt = len(self.tokens)
        self.stats = SpecStats()
        model = engine.target
        self.emitter = Emitter(self.sampling.max_tokens, self.sampling.stop, model.is_eog, model.piece)
        self.logprobs: list[TokenLogprob] = []
        # logit_bias and the penalties (edgespec/penalties.py): None when the request sets none
        self.adjuster = Adjuster(self.sampling, model.n_vocab, req.prompt_tokens, eog=model.eog_tokens) \
            if adjusts(self.sampling) else None
        self.check_kv = False  # tests turn this on: assert the KV invariants after every step
        self.guard_seen = False  # the goodput guard has seen this request decode (tick/schedule.py)
        self.closed_reason: FinishReason | None = None  # why close() ended it before it finished
        self.failure: str | None = None  # why the request failed on its own (finish reason "error")
        self.drafter_kind = drafter or engine.draft_kind
        # its parts (edgespec/session_parts.py): its drafter (drafters/base.py: Drafter) in its
        # range of the drafter's shared context, None for model-free drafts only
        self.draft_range = session_parts.draft_range(engine, req, slot, self.drafter_kind)
        has_draft = self.draft_range is not None
        self.drafter = session_parts.new_drafter(engine, slot, self.drafter_kind) if has_draft else None
        self.ngram = session_parts.new_lookups(engine, req)  # its prompt lookups (None: off)
        self.suffix = session_parts.new_suffix_drafter(engine, req)  # the cross-request suffix cache (None: off)
        # structured output: the grammar state of this request (edgespec/constraint.py); every
        # verified row is masked by the state after its node's path, drafts by their parent's
        self.matcher: Matcher | BudgetMatcher | None = req.matcher if req.matcher is not None else \
            engine.constraint_matcher(req.constraint) if req.constraint is not None else None
        self.controller = session_parts.new_controller(engine, req, slot, self.drafter_kind, has_draft) \
            if self.spec.mode == "auto" else None
        if self.spec.mode in ("chain", "tree") and not has_draft and not self.ngram and not self.suffix:
            raise BadRequest("mode", f"{self.spec.mode} needs a draft model or n-gram drafting")
        self.stats.cached_prompt_tokens = keep
        if self.drafter is not None:
            kept = slot.cache_of(self.drafter_kind) if engine.prompt_cache else None
            slot.set_cache(self.drafter_kind, None)  # nothing reusable until this request has ended cleanly
            self.stats.draft_cached_tokens = self.drafter.begin(self.tokens, kept, features_from=keep)
        self.prefill_pos = keep
        self.prefill_tokens = tuple(self.tokens[:-1])  # what the prompt's prefill leaves in seq 0
        self.n_past = keep
        self.state = SessionState.PREFILLING if keep < self.n_prompt - 1 else SessionState.READY
        # the state a step begun from (begin_step): a fused first step begins while PREFILLING
        self._before_step = self.state
        if self.state is SessionState.READY:  # all of it kept
            self._share_prompt()
        self._t_start = time.perf_counter()
        self.record: StepRecord | None = None  # the step under way (between begin_step and observe)

    # -- state --------------------------------------------------------------------------------
    @property
    def step_record(self) -> StepRecord:
        """The step under way (between begin_step and observe)."""
        if self.record is None:
            raise RuntimeError("no step under way")
        return self.record

    @property
    def done(self) -> bool:
        """Finished by itself (a stop, EOS, max_tokens: the emitter's reason) or closed."""
        return self.emitter.finish_reason is not None or self.state is SessionState.CLOSED

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.closed_reason or self.emitter.finish_reason

    @property
    def consistent(self) -> bool:
        """Whether the slot's caches are as the invariants say (not while a step's cells are
        uncommitted, nor after an aborted forward)."""
        return self.state in CONSISTENT

    @property
    def breaker_state(self) -> str | None:
        """closed / open / half_open for an auto request (None otherwise)."""
        return self.controller.state if self.controller is not None else None

    @property
    def out(self) -> list[int]:
        return self.emitter.out

    def abandon(self) -> None:
        """A forward of this session's tick was aborted (a cancel or a deadline): llama.cpp dropped
        part of its cells, so the slot keeps nothing of it (SlotPool.give_back)."""
        self.state = SessionState.ABANDONED

    @property
    def prefilling(self) -> bool:
        """Still reading its prompt (a fused first step may begin before the last piece is in)."""
        return self.state is SessionState.PREFILLING or (
            self.state is SessionState.STEPPING and self._before_step is SessionState.PREFILLING)

    @property
    def prefill_left(self) -> int:
        return max(0, self.n_prompt - 1 - self.prefill_pos)

    @property
    def remaining(self) -> int:
        return self.sampling.max_tokens - len(self.out)

    @property
    def context(self) -> int:
        """Positions in this session's part of the cache."""
        return self.n_past

    @property
    def cost(self) -> CostModel:
        """The engine's shared cost model (what the grafts price their place in a forward by)."""
        return self.engine.cost

    def step(self) -> Chunk:
        """One decoding step of this session alone: the ticks that prefill its prompt (whole
        n_batch chunks when alone, as a one-shot prefill would; in plain and auto the last one takes
        the first step too), or one tick that verifies."""
        if self.done:
            raise RuntimeError("session is finished")
        while self.prefilling:
            chunk = self.engine.tick([self])[self]
            if not self.prefilling and self.fuses_first:  # the last piece's tick took the first step
                return chunk
        return self.engine.tick([self])[self]

    # -- prefill ------------------------------------------------------------------------------
    def prefill_piece(self, limit: int) -> tuple[list[int], int]:
        """The next piece of the prompt to prefill, at most `limit` tokens and never across a
        multiple of n_batch: a prefill alone then runs exactly the n_batch batches a one-shot
        prefill would, which is what makes the prompt cache's whole chunks exact (engine.
        reusable_prefix). Returns (tokens, start position)."""
        start = self.prefill_pos
        chunk = self.slot.target.n_batch
        boundary = (start // chunk + 1) * chunk
        end = min(self.n_prompt - 1, start + max(1, limit), boundary)
        return self.tokens[start:end], start

    def prefill_done(self, n: int, features: np.ndarray | None = None) -> None:
        """`n` more prompt tokens are in the cache; `features`: the target's features of their
        rows (a head's target), for a drafter that reads them."""
        self.prefill_pos += n
        self.n_past = self.prefill_pos
        if features is not None and self.drafter is not None and self.drafter.features:
            self.drafter.add_features(features)
        if self.prefill_pos >= self.n_prompt - 1:  # the prompt is read
            if self.state is SessionState.STEPPING:  # a fused first step, begun while PREFILLING
                self._before_step = SessionState.READY
            else:
                self.state = SessionState.READY
            self._share_prompt()
            # decoding time starts after the target's prefill (the same in every mode, like
            # llama.cpp's eval time); the draft's own prefill happens in its first steps and counts
            self._t_start = time.perf_counter()

    def _share_prompt(self) -> None:
        """The prompt is read: with the prompt cache, other slots' requests may share its cells
        from now on, and a request drafting with a head lends them the head's positions and the
        prompt's features (Slot.lent, SlotPool.kept_prefill)."""
        if not self.engine.prompt_cache:
            return
        self.slot.prefill = self.prefill_tokens
        if self.drafter is not None and self.drafter.features:
            self.slot.lent = self.drafter.keep(self.tokens)

    # -- one step, in the tick's phases --------------------------------------------------------
    def decide(self) -> Decision:
        """What this request would speculate alone (its controller's decision, or its explicit
        mode). Changes nothing: the tick's `start` commits the controller's decision."""
        if self.remaining <= 1:
            return Decision(PLAIN)
        if self.controller is not None:
            backlog = self.drafter.backlog(self.tokens) if self.drafter is not None else 0
            return self.controller.decide(remaining=self.remaining, draft_backlog=backlog,
                                          context=self.n_past, emitted=len(self.out))
        return Decision(fixed_shape(self.spec.mode, self.spec.draft_tokens, self.spec.tree_nodes,
                                    self.spec.tree_depth))

    def begin_step(self, shape: Shape, batch: Batch | None = None, bare: bool = False) -> None:
        """`batch` (a tick of several sessions, schedule.Batch): prompt lookups are priced on the
        whole tick's verification, not on this step's alone. `bare`: the goodput guard holds this
        auto step plain, grafts and all; it looks nothing up either (a lookup, and the suffix
        cache's proposal it is keyed by, cost Python time that matters beside a fast forward)."""
        self._before_step = self.state
        self.state = SessionState.STEPPING  # until the step's KV commit is done
        st = StepRecord(shape, DraftTree.root(self.tokens[-1]), time.perf_counter(), batch=batch, bare=bare)
        if self.ngram is not None and self.remaining > 1 and not bare:
            # prompt lookup costs no forward pass; every lookup is scored against what the target
            # then emits (shadow evaluation), which sizes the grafts
            st.lookup, st.kind = self.ngram.look(self.tokens, self._suffix_firsts if self.suffix is not None else None)
        self.record = st

    def _suffix_firsts(self) -> set[int]:
        """The first tokens of the suffix cache's proposal for the context now (SuffixDrafter.look
        computes it once per context length; grafting reuses it)."""
        assert self.suffix is not None  # asked only with the suffix cache on (begin_step)
        prop = self.suffix.look(self.tokens)
        return {t for t, parent in zip(prop.tokens, prop.parents) if parent < 0}

    def cancel_step(self) -> None:
        """Drop a step begun but never verified (a schedule computed only to be inspected)."""
        self.record = None
        self.state = self._before_step

    def draft_steps(self) -> DraftSteps | None:
        """The drafter's generator for this step (edgespec/tick/draft.py drives it), or None."""
        st = self.step_record
        if st.shape.mode == "plain" or self.drafter is None or st.shape.depth <= 0 or self.remaining <= 1:
            return None
        mask = self._draft_mask if self.matcher is not None else None
        adjust = self._draft_adjust if self.adjuster is not None else None
        return self.drafter.propose_steps(st.tree, self.tokens, st.shape, self.sampling, self.rng, mask=mask,
                                          adjust=adjust)

    def _draft_adjust(self, logits: np.ndarray, path: list[int]) -> np.ndarray:
        """A draft row adjusted as the target's row at that node will be (penalties.py)."""
        assert self.adjuster is not None  # handed to the drafter only with one (draft_steps)
        return self.adjuster.row(logits, self.tokens[self.n_prompt:] + path)

    def _draft_mask(self, path: list[int]) -> np.ndarray:
        """What the grammar allows after the committed text and `path` (drafted tokens): drafts
        then propose only allowed tokens, which the target (masked alike) accepts more often."""
        assert self.matcher is not None  # handed to the drafter only with one (draft_steps)
        return self.matcher.mask_after(path)

    def absorb_steps(self, budget: int) -> DraftSteps:
        """The draft absorbs `budget` more tokens of its backlog this tick (a long catch-up in
        pieces, so it cannot stall the other sessions' tick); the step itself decodes plainly."""
        assert self.drafter is not None  # the schedule absorbs only a drafter's backlog
        return self.drafter.absorb_steps(self.tokens, budget)

    def drafted(self, report: DraftReport | None) -> None:
        """The drafter is done (report None: it did not run): graft prompt lookups, and under a
        constraint the tokens the grammar forces."""
        st = self.step_record
        if report is not None:
            st.draft_batches, st.levels = tuple(report.batches), report.levels
            st.spine_probs = tuple(report.spine_probs)
            st.draft_ran = bool(report.batches) and report.levels > 0
            self.stats.draft_forwards += len(report.batches)
        st.sources = [(1, "head" if self.drafter_kind == "eagle3" else "draft"), (len(st.tree), "prompt_lookup")]
        if not st.bare:
            graft.lookup(self, st)
        st.sources.append((len(st.tree), "suffix"))
        if self.suffix is not None and not st.bare:
            graft.suffix(self, st)
        st.guessed = len(st.tree) - 1
        st.sources.append((len(st.tree), "forced"))
        if self.matcher is not None and self.spec.mode != "plain" and self.remaining > 1:
            graft.forced(self, st)

    def room(self) -> int:
        """Draft tokens the request's context still has room for (the deepest position it may use)."""
        return self.slot.target.n_ctx - len(self.tokens) - 2

    def target_batch(self) -> tuple[list[int], list[int], list[list[int]]]:
        """This session's part of the tick's target forward: [root] + tree as (tokens, positions,
        global seq ids), in KV cell order (tick/layout.py)."""
        st = self.step_record
        st.layout, tokens, positions, seqs = layout.lay_out(st.tree, self.slot.target, self.n_past)
        return tokens, positions, seqs

    @property
    def fuses_first(self) -> bool:
        """Whether this request's first step rides in the forward that reads its prompt's last
        piece: plain and auto (explicit chain and tree modes keep their shape from the start)."""
        return self.spec.mode in ("plain", "auto")

    def first_step_batch(self, bare: bool = False) -> tuple[list[int], list[int], list[list[int]]]:
        """The first step, laid out behind the piece that ends the prompt in the same forward: the
        prompt's last token and the prompt lookups' and the suffix cache's grafts on it (no draft
        forward: a drafter has not read the prompt yet; `bare`: none either, the goodput guard has
        fallen back). `first_step` finishes it."""
        self.n_past = self.n_prompt - 1  # the piece ahead of it in the forward ends the prompt
        self.begin_step(PLAIN, bare=bare)
        self.drafted(None)
        return self.target_batch()

    def first_step(self, rows: np.ndarray, features: np.ndarray | None) -> Chunk:
        """Verify the first step (after the piece's prefill_done): a plain step with its grafts,
        which no controller judges (its forward is the prompt's)."""
        if features is not None:
            self.verified_features(features)
        chunk = self.finish_step(rows)
        self.record = None
        self.state = SessionState.READY
        return chunk

    def verified_features(self, features: np.ndarray) -> None:
        """The target's features of this step's batch entries (batch order), for finish_step."""
        self.step_record.features = features

    def finish_step(self, rows: np.ndarray) -> Chunk:
        """Verify this session's tree against its rows of the target forward (batch order),
        commit the KV in its sequence range, emit."""
        st = self.step_record
        tree, lay = st.tree, st.layout
        assert lay is not None  # laid out by target_batch
        if lay.order != list(range(len(tree))):
            rows = rows[np.argsort(lay.order)]  # back to node order (a copy)
        res, rows = verdict.verify(self, tree, rows)
        self.n_past = layout.commit(self.slot.target, lay, res.accepted)
        new_tokens = [tree.tokens[i] for i in res.accepted] + [res.token]
        if self.matcher is not None:  # up to an end-of-generation token (it ends the request)
            eog = next((k for k, t in enumerate(new_tokens) if self.engine.target.is_eog(t)), len(new_tokens))
            self.matcher.commit(new_tokens[:eog])
        self.tokens.extend(new_tokens)
        if self.ngram is not None:
            self.ngram.score(self.tokens)
        if self.suffix is not None:
            self.suffix.score(self.tokens)
        if self.drafter is not None and st.draft_ran:
            self.drafter.accept(tree, res.accepted, self.tokens)
        if st.features is not None and self.drafter is not None and self.drafter.features:
            # the context tokens this forward committed: the root and the accepted path
            at = {node: j for j, node in enumerate(lay.order)}
            self.drafter.add_features(st.features[[at[i] for i in [0, *res.accepted]]])
        self.state = SessionState.VERIFIED
        if self.check_kv:
            self.assert_kv_invariants()
        count_verified(self.stats, st, res)
        taken, text = self.emitter.push(new_tokens)
        lps: tuple[TokenLogprob, ...] = ()
        if self.req.logprobs is not None and taken:
            parents = [0] + list(res.accepted)  # the k-th emitted token was checked on its parent's row
            lps = tuple(token_logprob(rows[parents[k]], self.sampling, t, self.req.logprobs)
                        for k, t in enumerate(taken))
            self.logprobs.extend(lps)
        self.stats.emitted_tokens = len(self.out)
        st.result, st.emitted = res, len(new_tokens)
        if self.matcher is not None and (why := self.matcher.failure) is not None and self.failure is None:
            # the grammar can no longer be applied: this request fails, the tick goes on for the others
            self.failure = f"the constraint failed after {len(self.out)} generated tokens: {why}"
            self.closed_reason = "error"
        return Chunk(tuple(taken), text, self.finish_reason, lps)

    def observe(self, *, target_seconds: float, draft_seconds: float, verify_share: float, draft_share: float,
                step_seconds: float) -> None:
        """Stats and controller feedback after the tick. `target_seconds` / `draft_seconds`: the
        tick's forwards this step waited for; `verify_share` / `draft_share`: what this step alone
        would have cost, by the cost model scaled to the tick's measured speed (what the
        controller compares speculation against plain decoding with)."""
        st = self.step_record
        s = self.stats
        s.target_seconds += target_seconds
        s.draft_seconds += draft_seconds
        s.python_overhead_seconds += max(0.0, step_seconds - target_seconds - draft_seconds)
        s.seconds = time.perf_counter() - self._t_start
        if self.controller is not None:
            overhead = max(0.0, step_seconds - target_seconds - draft_seconds)
            self.controller.observe(outcome(st, draft_share=draft_share, verify_share=verify_share,
                                            overhead_seconds=overhead))
            s.breaker_transitions = len(self.controller.breaker.transitions)
        self.record = None
        self.state = SessionState.READY

    # -- KV -----------------------------------------------------------------------------------
    def assert_kv_invariants(self) -> None:
        """Main sequence = context minus the pending root, nothing else survives (target and
        draft; tick/layout.py: check)."""
        layout.check(self.slot.target, self.tokens)
        if self.drafter is not None:
            self.drafter.check_kv(self.tokens)

    # -- output -------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        return self.emitter.visible()

    def result(self) -> GenerationResult:
        self.stats.seconds = time.perf_counter() - self._t_start
        return GenerationResult(self.emitter.visible(), list(self.out), self.finish_reason or "length",
                                self.n_prompt, self.stats, list(self.logprobs))

    def controller_summary(self) -> dict[str, Any] | None:
        return self.controller.summary() if self.controller is not None else None

    def close(self, reason: FinishReason | None = None) -> None:
        if self.emitter.finish_reason is None and self.closed_reason is None:
            self.closed_reason = reason or "cancelled"
        try:
            self.engine.release(self)  # reads the state it ends in (SlotPool.give_back)
        finally:
            self.state = SessionState.CLOSED
