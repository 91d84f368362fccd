"""The speculative engine: slots, sessions and the step loop.

A session's context is `tokens` = prompt + emitted. Invariant between steps: the target's seq 0
holds exactly tokens[:-1]; tokens[-1] (the root) is decoded by the next step together with the
drafted tree, in ONE target forward. Plain decoding is the same step with an empty tree.

One step:
    shape  = controller.choose()                  (or the fixed shape of an explicit mode)
    tree   = drafters propose (draft model levels, then n-gram graft)
    target decodes [root] + tree; node i carries the seq ids of every leaf below it
    result = verify(tree, target distributions)   (greedy or exact rejection sampling)
    commit: seq 0 := tokens + accepted; every other seq is emptied (rejected cells are gone)
    emit accepted tokens + the bonus/recovered token, stopping exactly where plain decoding would
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgespec import backend, chat
from edgespec.config import EngineConfig
from edgespec.controller.shapes import PLAIN, Shape, StepOutcome, chain, eagle
from edgespec.drafters import ModelDrafter, NgramDrafter
from edgespec.drafters.model import DraftCache
from edgespec.drafters.ngram import lookup
from edgespec.errors import BadRequest, ModelError, Overloaded
from edgespec.logs import get_logger
from edgespec.sampling import SamplingParams, logits_to_probs
from edgespec.tree import DraftTree
from edgespec.types import Chunk, FinishReason, GenerationRequest, GenerationResult, SpecStats
from edgespec.verify import VerifyResult, verify_greedy, verify_stochastic

log = get_logger("edgespec.engine")

# explicit-mode tree defaults beyond the request's (depth, nodes): EAGLE-2 top-4 branching,
# two frontier nodes expanded per level
TREE_WIDTH = 4
TREE_EXPAND = 2
# prompt lookup in auto mode's plain steps: at most this many tokens, reach learnt with this EWMA weight
NGRAM_MAX = 8
NGRAM_EWMA = 0.15


def fixed_shape(mode: str, draft_tokens: int, tree_nodes: int, tree_depth: int) -> Shape:
    if mode == "plain":
        return PLAIN
    if mode == "chain":
        return chain(draft_tokens)
    return eagle(tree_depth, TREE_WIDTH, TREE_EXPAND, tree_nodes)


@dataclass
class Slot:
    index: int
    target: backend.Context
    draft: backend.Context | None
    busy: bool = False
    # the prompt tokens (all but the last) whose KV a finished request's prefill left in the
    # target's sequence 0; () when the cache holds nothing reusable
    prefill: tuple[int, ...] = ()
    # what the last request left in the draft's sequence 0 (any shared prefix is reusable there:
    # the draft needs no bit-exactness); None when nothing
    draft_cache: DraftCache | None = None
    # the whole context (prompt and reply) of the last request that ended cleanly: what idle time
    # may bring the draft cache up to (Engine.idle_work)
    last_context: tuple[int, ...] = ()

    def reset(self) -> None:
        """Empty both caches; nothing is reusable."""
        self.target.clear()
        if self.draft is not None:
            self.draft.clear()
        self.prefill = ()
        self.draft_cache = None
        self.last_context = ()


def reusable_prefix(prefill: Sequence[int], prompt: Sequence[int], chunk: int) -> int:
    """Leading positions of `prompt` whose KV a slot may keep from its last prefill: their common
    prefix (the prompt's last token is never prefilled), cut to whole `chunk`s. A prefill's
    batches start at position 0 and every `chunk` (n_batch) tokens, and a batch of that size is
    computed the same whatever follows it, so a kept chunk holds exactly the KV this prompt's own
    prefill would write, bit for bit, and the rest is prefilled in the chunks a fresh prefill
    would use. A partial last chunk (a small batch, another kernel) is recomputed."""
    n = min(len(prefill), len(prompt) - 1)
    if n < chunk:
        return 0
    a = np.asarray(prefill[:n])
    b = np.asarray(prompt[:n])
    diff = np.flatnonzero(a != b)
    common = int(diff[0]) if len(diff) else n
    return common // chunk * chunk


class Engine:
    """Loaded models, per-slot contexts, the shared cost model and acceptance prior."""

    def __init__(self, cfg: EngineConfig, target: backend.Model, draft: backend.Model | None, slots: list[Slot]):
        self.cfg = cfg
        self.target = target
        self.draft = draft
        self.slots = slots
        from edgespec.controller import AcceptancePrior, ControllerConfig, CostModel

        self.controller_cfg = ControllerConfig()
        self.cost = CostModel()
        self.prior = AcceptancePrior()
        self._owner = threading.get_ident()

    # -- lifecycle ----------------------------------------------------------------------------
    @classmethod
    def load(cls, cfg: EngineConfig, controller_cfg=None, calibrate: bool = True) -> Engine:
        cfg.validate()
        target = backend.Model(cfg.target.path, cfg.target.n_gpu_layers)
        draft = None
        if cfg.draft is not None:
            draft = backend.Model(cfg.draft.path, cfg.draft.n_gpu_layers)
            backend.check_compatible(target, draft)
        n_seq = cfg.max_tree_leaves + 1
        slots = []
        for i in range(cfg.parallel):
            t = backend.Context(target, cfg.target, n_seq_max=n_seq)
            d = backend.Context(draft, cfg.draft, n_seq_max=n_seq) if draft is not None else None
            slots.append(Slot(i, t, d))
        eng = cls(cfg, target, draft, slots)
        if controller_cfg is not None:
            eng.controller_cfg = controller_cfg
        if calibrate:
            eng.calibrate()
        log.info("engine_loaded", target=str(cfg.target.path), draft=str(cfg.draft.path) if cfg.draft else None,
                 slots=cfg.parallel, backend=eng.backend_name)
        return eng

    @property
    def backend_name(self) -> str:
        return "cuda" if (self.cfg.target.n_gpu_layers != 0 and backend.gpu_offload_supported()) else "cpu"

    def calibrate(self, sizes: Sequence[int] = (1, 2, 3, 4, 6, 8, 12, 16, 32), repeats: int = 3,
                  budget_seconds: float = 0.25) -> None:
        """Time target and draft forwards per batch size on slot 0, so the controller's cost model
        describes this machine. The sizes are those whose first timing, in increasing order, fits
        in `budget_seconds` per model (about 0.25 s here, far less on a GPU); then `repeats - 1`
        more rounds over all of them, and each size keeps its fastest. Rounds, not repeats in a
        row: a slow moment (another tenant, the page cache still filling after load) then
        inflates one timing of every size instead of every timing of the first sizes."""
        slot = self.slots[0]

        def measure(ctx, n: int, all_logits: bool = False) -> float:
            # as the steps use them: verification needs every token's logits, a draft catch-up the
            # last token's only (the demo draft's Q8_0 output head: 6.1 vs 8.2 ms for 2 tokens)
            out = [True] * n if ctx is slot.target or all_logits else [False] * (n - 1) + [True]
            t0 = time.perf_counter()
            ctx.decode([self.target.bos] * n, range(32, 32 + n), [(0,)] * n, out)
            dt = time.perf_counter() - t0
            ctx.seq_rm(0, 32, -1)
            return dt

        kinds = ("target", "draft") if slot.draft is not None else ("target",)
        table: dict[str, dict[int, float]] = {}
        for kind in kinds:
            ctx = slot.target if kind == "target" else slot.draft
            ctx.clear()
            ctx.decode_seq([self.target.bos] * 32, 0, (0,), last_logits=False)  # a short prefix
            for _ in range(2):
                measure(ctx, 4)  # warm-up: the first decodes allocate buffers and fault pages in
            spent, table[kind] = 0.0, {}
            for n in (s for s in sizes if s <= self.cfg.target.n_batch):
                if spent > budget_seconds and len(table[kind]) >= 4:
                    break  # the cost model extrapolates linearly beyond the last size
                table[kind][n] = measure(ctx, n)
                spent += table[kind][n]
            for _ in range(repeats - 1):
                for n in table[kind]:
                    table[kind][n] = min(table[kind][n], measure(ctx, n))
        row = None
        n = max((k for k in table.get("draft", {}) if k <= 4), default=1)
        if n > 1:  # what each extra output row (a tree expansion's) adds to the catch-up timed above
            every = min(measure(slot.draft, n, all_logits=True) for _ in range(repeats))
            row = (every - table["draft"][n]) / (n - 1)
        measured = tuple(sorted(set(table["target"]) & set(table.get("draft", table["target"]))))
        self.cost.calibrate(lambda kind, n: table[kind][n], sizes=measured, kinds=kinds, draft_row=row, context=32)
        for s in self.slots:
            s.reset()

    def warmup(self) -> None:
        toks = self.tokenize("Hello")
        self.generate(GenerationRequest(tuple(toks), SamplingParams(max_tokens=2)))

    def close(self) -> None:
        for s in self.slots:
            s.target.close()
            if s.draft is not None:
                s.draft.close()
        self.target.close()
        if self.draft is not None:
            self.draft.close()

    # -- text ---------------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.slots[0].target.n_ctx

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.target.tokenize(text, add_special, parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.target.detokenize(ids)

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> str:
        return self.target.chat_prompt(messages)

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Chat template -> tokens: special tokens from the template only (edgespec.chat)."""
        return chat.encode_chat(self.target, messages)

    @property
    def encoder(self) -> backend.Model:
        """The target's vocabulary and chat template, safe to use from any thread (tokenize and
        chat_prompt only read the loaded model): the daemon tokenises in its handler threads."""
        return self.target

    def model_info(self) -> dict:
        t, d = self.target, self.draft
        return {
            "target": {"path": str(t.path), "desc": t.desc, "n_params": t.n_params, "size_bytes": t.size_bytes},
            "draft": None if d is None else {"path": str(d.path), "desc": d.desc, "n_params": d.n_params,
                                             "size_bytes": d.size_bytes},
            "n_vocab": t.n_vocab,
            "n_ctx": self.n_ctx,
            "parallel": len(self.slots),
            "backend": self.backend_name,
        }

    def next_logits(self, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray | None]:
        """Target and draft logits for the token after `tokens` (uses a free slot; for selftest)."""
        slot = next((s for s in self.slots if not s.busy), None)
        if slot is None:
            raise Overloaded("no free slot")
        out = []
        for ctx in (slot.target, slot.draft):
            if ctx is None:
                out.append(None)
                continue
            ctx.clear()
            ctx.decode_seq(list(tokens), 0, (0,), last_logits=True)
            out.append(ctx.logits(-1).copy())
            ctx.clear()
        slot.prefill = ()
        return out[0], out[1]

    # -- sessions -----------------------------------------------------------------------------
    def idle_work(self, budget: int = 16) -> bool:
        """Use idle time: let a free slot's draft absorb up to `budget` more tokens of the last
        context that slot served (its prompt and reply), so that a request sharing a prefix with it
        (a system prompt, a document asked about again, a chat's next turn) finds the draft already
        there and speculates from its second step, instead of paying the draft's prefill (~1 ms a
        token here), which auto often declines to pay for a long prompt. The draft needs no
        bit-exactness, so this is only a matter of time. Call it only when no request waits: one
        call is one draft forward of at most `budget` tokens. Returns whether it did any (call it
        again until it returns False)."""
        if not self.cfg.prompt_cache or self.draft is None:
            return False
        for slot in self.slots:
            ctx = slot.last_context
            held = slot.draft_cache.tokens if slot.draft_cache is not None else ()
            if slot.busy or slot.draft is None or len(ctx) < 2 or len(held) >= len(ctx):
                continue
            window = self.cfg.draft_window
            d = ModelDrafter(slot.draft, window=window)
            tokens = list(ctx)
            d.begin(tokens, slot.draft_cache)
            if len(tokens) - d.n_past > window:
                # as a request would: the draft holds the context's last `window` tokens, not all
                # of a long one (its every forward would pay attention over them)
                d.start_at(len(tokens) - window)
            d.absorb(tokens, budget)
            slot.draft_cache = DraftCache(d.offset, tuple(tokens[:d.n_past]))
            return True
        return False

    @property
    def free_slots(self) -> int:
        return sum(not s.busy for s in self.slots)

    def open_session(self, req: GenerationRequest) -> Session:
        if not req.prompt_tokens:
            raise BadRequest("prompt", "is empty")
        n_prompt = len(req.prompt_tokens)
        budget = self.n_ctx - req.speculation.context_headroom
        if n_prompt + req.sampling.max_tokens > budget:
            raise BadRequest(
                "prompt",
                f"{n_prompt} prompt tokens + max_tokens {req.sampling.max_tokens} exceed the context "
                f"({self.n_ctx} tokens, {budget} usable with speculation headroom)",
            )
        bad = [t for t in req.prompt_tokens if not 0 <= t < self.target.n_vocab]
        if bad:
            raise BadRequest("prompt_tokens", f"token id {bad[0]} outside [0, {self.target.n_vocab})")
        free = [s for s in self.slots if not s.busy]
        if not free:
            raise Overloaded(f"all {len(self.slots)} slots are busy")
        slot = free[0]
        if self.cfg.prompt_cache and len(free) > 1:  # the free slot whose cache this prompt can reuse most
            chunk = self.cfg.target.n_batch
            slot = max(free, key=lambda s: (reusable_prefix(s.prefill, req.prompt_tokens, chunk),
                                            s.draft_cache.reusable(req.prompt_tokens) if s.draft_cache else 0))
        slot.busy = True
        try:
            return Session(self, slot, req)
        except BaseException:
            slot.busy = False
            raise

    def generate(self, req: GenerationRequest) -> GenerationResult:
        sess = self.open_session(req)
        try:
            while not sess.done:
                sess.step()
            return sess.result()
        finally:
            sess.close()


class Session:
    """One request on one slot. Not thread-safe: driven by the engine thread."""

    def __init__(self, engine: Engine, slot: Slot, req: GenerationRequest):
        from edgespec.controller import Controller

        self.engine = engine
        self.slot = slot
        self.req = req
        self.sampling = req.sampling
        self.spec = req.speculation
        seed = req.sampling.seed if req.sampling.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.rng = np.random.default_rng(seed)
        self.tokens: list[int] = list(req.prompt_tokens)
        self.n_prompt = len(self.tokens)
        self.out: list[int] = []
        self.stats = SpecStats()
        self.finish_reason: FinishReason | None = None
        self._text_bytes = b""
        self._sent_chars = 0
        self._t_start = time.perf_counter()
        self.check_kv = False  # tests turn this on: assert the KV invariants after every step
        has_draft = slot.draft is not None
        self.drafter = ModelDrafter(slot.draft, window=engine.cfg.draft_window) if has_draft else None
        self.ngram = NgramDrafter() if self.spec.ngram else None
        # P(target accepts > j lookup tokens), learnt per kind of lookup: [0] the context's last
        # n >= n_min tokens occurred before, [1] only its last token did (weaker, but on a flat
        # verification curve a 1-token guess costs almost nothing)
        self._ngram_reach = [[0.5 * 0.8 ** j for j in range(NGRAM_MAX)], [0.2 * 0.5 ** j for j in range(NGRAM_MAX)]]
        self._lookups: list[tuple[int, list[int], int]] = []  # (position, lookup, kind) awaiting their fate
        self.controller = None
        max_depth = self.spec.tree_depth
        if self.spec.mode == "auto":
            self.controller = Controller(engine.controller_cfg, engine.cost, engine.prior,
                                         max_depth=max_depth, max_nodes=self.spec.tree_nodes,
                                         has_draft_model=has_draft)
        if self.spec.mode in ("chain", "tree") and not has_draft and not self.ngram:
            raise BadRequest("mode", f"{self.spec.mode} needs a draft model or n-gram drafting")
        keep = 0
        if engine.cfg.prompt_cache:
            keep = reusable_prefix(slot.prefill, self.tokens, slot.target.n_batch)
        if keep:
            slot.target.seq_rm(0, keep, -1)  # what a finished request left beyond the kept chunks
        else:
            slot.target.clear()
        slot.prefill = ()  # nothing reusable until this prefill has completed
        self.stats.cached_prompt_tokens = keep
        if self.drafter is not None:
            kept = slot.draft_cache if engine.cfg.prompt_cache else None
            slot.draft_cache = None  # nothing reusable until this request has ended cleanly
            self.stats.draft_cached_tokens = self.drafter.begin(self.tokens, kept)
        # prefill: everything but the last prompt token (the first root), from the kept chunks on
        if len(self.tokens) > 1:
            slot.target.decode_seq(self.tokens[keep:-1], keep, (0,), last_logits=False)
        self._prefill = tuple(self.tokens[:-1])
        self._consistent = True  # the caches are as the invariants say (false while a step runs)
        self.n_past = len(self.tokens) - 1
        # decoding time starts after the target's prefill (the same in every mode, like llama.cpp's
        # eval time); the draft's own prefill happens in its first step and is counted
        self._t_start = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    # -- one step -----------------------------------------------------------------------------
    def _shape(self) -> Shape:
        if self.controller is not None:
            backlog = self.drafter.backlog(self.tokens) if self.drafter is not None else 0
            return self.controller.choose(remaining=self.sampling.max_tokens - len(self.out), draft_backlog=backlog,
                                          context=self.n_past, emitted=len(self.out))
        return fixed_shape(self.spec.mode, self.spec.draft_tokens, self.spec.tree_nodes, self.spec.tree_depth)

    def step(self) -> Chunk:
        if self.done:
            raise RuntimeError("session is finished")
        self._consistent = False  # until the step's KV commit is done
        t_step = time.perf_counter()
        target_before, draft_before = self._decode_split()
        shape = self._shape()
        remaining = self.sampling.max_tokens - len(self.out)
        tree = DraftTree.root(self.tokens[-1])
        draft_seconds, draft_batches, levels, spine_probs = 0.0, (), 0, ()
        ngram_only = False
        prop: list[int] = []
        kind = 0
        if self.ngram is not None and remaining > 1:
            # prompt lookup costs no forward pass; every lookup is scored against what the target
            # then emits (shadow evaluation), which sizes the grafts below
            prop = lookup(self.tokens, NGRAM_MAX, self.ngram.n_max, self.ngram.n_min)
            if not prop and self.ngram.n_min > 1:
                prop, kind = lookup(self.tokens, NGRAM_MAX, 1, 1), 1
            if prop:
                self._lookups.append((len(self.tokens), prop, kind))
        room = self.slot.target.n_ctx - len(self.tokens) - 2  # deepest position the KV can hold
        if shape.mode != "plain" and remaining > 1:
            if self.drafter is not None and shape.depth > 0:
                rep = self.drafter.propose(tree, self.tokens, shape, self.sampling, self.rng)
                draft_seconds, draft_batches, levels = rep.seconds, tuple(rep.batches), rep.levels
                spine_probs = tuple(rep.spine_probs)
                self.stats.draft_forwards += len(rep.batches)
            if prop:
                if self.drafter is None and kind == 0:  # n-gram-only speculation: its own tree
                    self.ngram.propose(tree, self.tokens, shape, self.sampling, self.rng,
                                       limit=None if room >= self.ngram.max_tokens else max(0, room))
                else:  # graft as many lookup tokens as pay for their verification
                    k = min(self._ngram_budget(len(tree), kind), room)
                    if k > 0:
                        self.ngram.graft(tree, prop[:k])
        elif self.controller is not None and prop:
            # auto mode decoding plainly: graft a lookup when its measured yield pays for the
            # extra verification tokens
            k = min(self._ngram_budget(1, kind), room)
            if k > 0:
                self.ngram.graft(tree, prop[:k])
                ngram_only = tree.n_draft > 0

        # ONE target forward over [root] + tree
        tgt = self.slot.target
        leaves, below = tree.leaf_sets()
        if len(leaves) > tgt.n_seq_max:
            raise ModelError(f"tree has {len(leaves)} leaves > n_seq_max {tgt.n_seq_max}")
        spine = self._spine(tree)
        seq_of_leaf = self._leaf_seqs(leaves, spine[-1])
        for s in seq_of_leaf:
            if s != 0:
                tgt.seq_cp(0, s, -1, -1)
        root_pos = self.n_past
        # batch order = KV cell order: the root and the first-child spine first, so an accepted
        # spine prefix sits in consecutive cells exactly as one-token decoding would place it (with
        # the patched ggml, see tools/patches/, its logits and KV are then bit-identical to plain
        # decoding's); the other branches follow
        on_spine = set(spine)
        order = spine + [i for i in range(len(tree)) if i not in on_spine]  # the identity for a chain
        seqs = [[seq_of_leaf[li] for li in below[i]] for i in range(len(tree))]
        t0 = time.perf_counter()
        tgt.decode([tree.tokens[i] for i in order], [root_pos + tree.depths[i] for i in order],
                   [seqs[i] for i in order], [True] * len(tree))
        verify_seconds = time.perf_counter() - t0
        rows = tgt.logits_rows(len(tree))
        if order != list(range(len(tree))):
            rows = rows[np.argsort(order)]  # back to node order (a copy)
        if self.sampling.greedy:
            res = verify_greedy(tree, np.argmax(rows, axis=1))
        else:
            res = verify_stochastic(tree, lambda i: logits_to_probs(rows[i], self.sampling), self.rng)

        if ngram_only:
            self.stats.steps_per_mode["ngram"] = self.stats.steps_per_mode.get("ngram", 0) + 1
        # commit the KV: seq 0 := context + accepted path; every other seq emptied
        self._commit(tree, res, leaves, below, seq_of_leaf, root_pos)
        new_tokens = [tree.tokens[i] for i in res.accepted] + [res.token]
        self.tokens.extend(new_tokens)
        if self._lookups:
            self._score_lookups()
        if self.drafter is not None:
            if shape.mode != "plain" and draft_batches:
                self.drafter.accept(tree, res.accepted, self.tokens)
        self._consistent = True
        if self.check_kv:
            self.assert_kv_invariants()

        # stats + controller feedback
        st = self.stats
        st.target_forwards += 1
        st.drafted_tokens += tree.n_draft
        st.accepted_tokens += len(res.accepted)
        for d in range(len(res.accepted)):
            if len(st.accepted_per_depth) <= d:
                st.accepted_per_depth.append(0)
            st.accepted_per_depth[d] += 1
        if not ngram_only:
            st.steps_per_mode[shape.kind] = st.steps_per_mode.get(shape.kind, 0) + 1
        if self.controller is None:  # in auto mode the controller's observe() refines the costs
            self.engine.cost.observe_step(len(tree), verify_seconds, draft_batches, draft_seconds, context=root_pos)
        chunk = self._emit(new_tokens)
        step_seconds = time.perf_counter() - t_step
        target_after, draft_after = self._decode_split()
        st.target_seconds += target_after - target_before
        st.draft_seconds += draft_after - draft_before
        st.python_overhead_seconds += step_seconds - (target_after - target_before) - (draft_after - draft_before)
        if self.controller is not None:
            self.controller.observe(StepOutcome(
                shape=shape, accepted_ranks=tuple(res.ranks), offered=tuple(res.offered),
                emitted=len(new_tokens), draft_seconds=draft_seconds, draft_batches=draft_batches,
                verify_seconds=verify_seconds, verify_tokens=len(tree), depth_drafted=levels,
                overhead_seconds=max(0.0, step_seconds - verify_seconds - draft_seconds),
                spine_probs=spine_probs, context=root_pos))
            st.breaker_transitions = len(self.controller.breaker.transitions)
        st.seconds = time.perf_counter() - self._t_start
        return chunk

    def _ngram_budget(self, base: int, kind: int = 0) -> int:
        """Lookup tokens worth adding to a verification batch of `base` tokens: the k <= NGRAM_MAX
        maximising E[min(L, k)] - (verify(base + k) - verify(base)) / verify(1), i.e. expected
        extra tokens minus the extra verification time priced in plain-decoding tokens (0 if no k
        gains). L is how many lookup tokens the target would accept; P(L > j) is learnt for free
        by scoring every lookup against the tokens actually emitted (`_score_lookups`)."""
        cost = self.engine.cost.at(self.n_past)
        unit = cost.verify_seconds(1)
        v0 = cost.verify_seconds(base)
        best, best_gain = 0, 0.02
        expected = 0.0
        for k in range(1, NGRAM_MAX + 1):
            expected += self._ngram_reach[kind][k - 1]
            gain = expected - (cost.verify_seconds(base + k) - v0) / unit
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def _score_lookups(self) -> None:
        """Update P(L > j) from lookups whose fate is now known (shadow evaluation: the lookup
        at a position is compared with the tokens that were emitted after it)."""
        keep = []
        for start, prop, kind in self._lookups:
            got = self.tokens[start:start + len(prop)]
            match = 0
            while match < len(got) and got[match] == prop[match]:
                match += 1
            if match < len(got) or len(got) == len(prop):  # resolved: a mismatch seen, or all matched
                reach = self._ngram_reach[kind]
                for j in range(NGRAM_MAX):
                    hit = 1.0 if match > j else 0.0
                    reach[j] += NGRAM_EWMA * (hit - reach[j])
            else:
                keep.append((start, prop, kind))
        self._lookups = keep

    @staticmethod
    def _spine(tree: DraftTree) -> list[int]:
        """Root, its first child, that child's first child, ... down to a leaf (a chain: all)."""
        children = tree.children()
        spine, n = [0], 0
        while children[n]:
            n = children[n][0]
            spine.append(n)
        return spine

    @staticmethod
    def _leaf_seqs(leaves: list[int], spine_leaf: int) -> list[int]:
        """Seq id per leaf ordinal: the leaf on the first-child spine gets seq 0 (the common
        case then commits without a copy), the others 1, 2, ..."""
        out, nxt = [], 1
        for leaf in leaves:
            if leaf == spine_leaf:
                out.append(0)
            else:
                out.append(nxt)
                nxt += 1
        return out

    def _commit(self, tree: DraftTree, res: VerifyResult, leaves: list[int], below: list[list[int]],
                seq_of_leaf: list[int], root_pos: int) -> None:
        tgt = self.slot.target
        last = res.accepted[-1] if res.accepted else 0
        end = root_pos + 1 + len(res.accepted)  # cells to keep: [0, end)
        src = seq_of_leaf[below[last][0]]
        if 0 in (seq_of_leaf[li] for li in below[last]):
            src = 0
        if src != 0:
            tgt.seq_rm(0, root_pos + 1, -1)
            tgt.seq_cp(src, 0, root_pos + 1, end)
        else:
            tgt.seq_rm(0, end, -1)
        for s in seq_of_leaf:
            if s != 0:
                tgt.seq_rm(s, -1, -1)
        self.n_past = end

    def _decode_split(self) -> tuple[float, float]:
        """Seconds spent so far inside llama_decode: (target, draft)."""
        d = self.slot.draft
        return self.slot.target.decode_seconds, (d.decode_seconds if d is not None else 0.0)

    def assert_kv_invariants(self) -> None:
        """Main sequence = context minus the pending root, nothing else survives (target and draft)."""
        tgt = self.slot.target
        assert tgt.pos_min(0) in (0, -1) and tgt.pos_max(0) == len(self.tokens) - 2, \
            f"target seq 0 holds [{tgt.pos_min(0)}, {tgt.pos_max(0)}], expected [0, {len(self.tokens) - 2}]"
        for s in range(1, tgt.n_seq_max):
            assert tgt.pos_max(s) == -1, f"target seq {s} still holds cells (up to pos {tgt.pos_max(s)})"
        if self.drafter is not None:
            d = self.drafter.ctx
            want = self.drafter.n_past - 1 - self.drafter.offset
            assert d.pos_max(0) == want, f"draft seq 0 ends at {d.pos_max(0)}, expected {want}"
            assert self.drafter.n_past <= len(self.tokens) - 1
            for s in range(1, d.n_seq_max):
                assert d.pos_max(s) == -1, f"draft seq {s} still holds cells"

    # -- output -------------------------------------------------------------------------------
    def _emit(self, new_tokens: list[int]) -> Chunk:
        """Append tokens one by one, ending exactly where plain decoding would (EOS, stop string,
        max_tokens); returns the chunk of newly final text."""
        model = self.engine.target
        taken: list[int] = []
        stop = self.sampling.stop
        for t in new_tokens:
            if model.is_eog(t):
                self.finish_reason = "eos"
                break
            self.out.append(t)
            taken.append(t)
            self._text_bytes += model.piece(t)
            if stop:
                text = self._text_bytes.decode("utf-8", errors="replace")
                cut = _find_stop(text, stop, self._sent_chars)
                if cut is not None:
                    self._final_text = text[:cut]
                    self.finish_reason = "stop"
                    break
            if len(self.out) >= self.sampling.max_tokens:
                self.finish_reason = "length"
                break
        self.stats.emitted_tokens = len(self.out)
        text = self._visible_text()
        delta = text[self._sent_chars:]
        self._sent_chars = len(text)
        return Chunk(tuple(taken), delta, self.finish_reason)

    def _visible_text(self) -> str:
        if self.finish_reason == "stop":
            return self._final_text
        text = self._text_bytes.decode("utf-8", errors="replace")
        if self.finish_reason is None:
            # hold back an incomplete UTF-8 tail and anything that may start a stop string
            while text.endswith("\ufffd"):
                text = text[:-1]
            hold = max((_overlap(text, s) for s in self.sampling.stop), default=0)
            text = text[: len(text) - hold]
        return text

    @property
    def text(self) -> str:
        return self._visible_text()

    def result(self) -> GenerationResult:
        self.stats.seconds = time.perf_counter() - self._t_start
        return GenerationResult(self._visible_text(), list(self.out), self.finish_reason or "length",
                                self.n_prompt, self.stats)

    def controller_summary(self) -> dict | None:
        return self.controller.summary() if self.controller is not None else None

    def close(self, reason: FinishReason | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason or "cancelled"
        if self.controller is not None:
            try:
                self.engine.prior.update_from(self.controller)
            except Exception:  # the prior is an optimisation; never fail a request on it
                log.warning("prior_update_failed", exc_info=True)
            self.controller = None
        if self.slot.busy:
            keep = self.engine.cfg.prompt_cache and getattr(self, "_consistent", False)
            if self.drafter is not None:
                # the draft keeps all it holds, the reply included: a chat's next turn starts with it
                self.slot.draft_cache = self.drafter.keep(self.tokens) if keep else None
                if self.slot.draft_cache is None:
                    self.drafter.end()
            self.slot.last_context = tuple(self.tokens) if keep else ()
            if keep:
                # keep the prompt prefill's cells for the next request (seq 0 holds the context, the
                # other sequences are empty after every step); drop what decoding wrote after them
                self.slot.target.seq_rm(0, len(self._prefill), -1)
                self.slot.prefill = self._prefill
            else:
                self.slot.target.clear()
                self.slot.prefill = ()
            self.slot.busy = False


def _find_stop(text: str, stops: Sequence[str], since: int) -> int | None:
    """Index where the earliest stop string starts, searching only text not yet sent."""
    best = None
    for s in stops:
        i = text.find(s, max(0, since - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
