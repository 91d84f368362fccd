"""The speculative engine: loaded models, the shared contexts and their slots.

ONE target context and ONE draft context serve every slot (`kv_unified`): slot i owns a range of
sequence ids (edgespec/kv.py), its main sequence plus its tree's branches. The engine's tick
(edgespec/tick/) decodes every active session's [root] + tree in one target forward; a session
(edgespec/session.py) is one request on one slot. Plain decoding is the same tick with empty
trees; a request alone is a tick over one session.

The draft is a draft model or an EAGLE-3 head (a `[draft] path` whose GGUF architecture is
`eagle3`, detected at load): then the target context is a FeatureContext (its features go to
each session's head drafter after every target forward) and the shared draft context is the
head's (backend.HeadContext), with the same slot ranges.

Both at once (`EngineConfig.head` beside a draft model): the engine holds the draft model's context
and the head's, each slot a range in both, and each request drafts with the one the measured
costs and acceptances favour at the load it meets (`choose_drafter`,
edgespec/controller/drafter_choice.py); each drafter keeps its own acceptance prior and cost curve.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from functools import partial

import numpy as np

from edgespec import backend, chat
from edgespec.config import EngineConfig, shared_cells
from edgespec.controller import AcceptancePrior, Controller, ControllerConfig, CostModel
from edgespec.controller.drafter_choice import DrafterChoice
from edgespec.controller.goodput import GoodputGuard
from edgespec.controller.threads import ThreadGovernor
from edgespec.drafters import draft_kind, drafter_class
from edgespec.drafters.base import decode_batch
from edgespec.drafters.ngram import ReachPriors
from edgespec.drafters.suffix import SuffixCache, SuffixDrafter
from edgespec.economics import drafter_verdict
from edgespec.errors import BadRequest, ForwardAborted, Overloaded
from edgespec.kv import SeqRange
from edgespec.logs import get_logger
from edgespec.prompt_store import PromptStore
from edgespec.sampling import SamplingParams
from edgespec.session import NGRAM_MAX, Session, fixed_shape  # noqa: F401 - re-exported
from edgespec.slots import Slot, SlotPool, seqs_per_slot
from edgespec.tick import tick as run_tick
from edgespec.types import Chunk, GenerationRequest, GenerationResult

log = get_logger("edgespec.engine")

# a drafter is left idle when no chain of it pays even at this per-token acceptance (a good draft's:
# the demo's Q8_0 twin reaches 0.9-0.95, real 3-5 % drafts 0.6-0.8), so a noisy calibration does
# not idle a draft that would pay
JUDGED_AT = 0.9
# calibration times every size up to this one whatever its budget: a tick of 8 sessions verifies
# 8 to 40 tokens, and a curve extrapolated from sizes 1-4 priced each of them at the 3-to-4 slope
CALIBRATE_AT_LEAST = 16


def pad_forwards(cost, contexts: tuple, cfg: EngineConfig):
    """`cost`, and where `[speculation] pad_forwards` asks for it (auto: a target on a GPU) its
    forwards priced at the fixed widths (controller/widths.py) and the target's and draft model's
    contexts padding each forward to the width it is priced at (backend.Context): a shape that
    repeats from step to step keeps a GPU's CUDA graph warm. An EAGLE-3 head is not padded."""
    from edgespec.controller.widths import WIDTHS

    on = cfg.pads_forwards(cfg.target.n_gpu_layers != 0 and backend.gpu_offload_supported())
    log.info("pad_forwards", on=on, setting=cfg.pad_forwards, widths=list(WIDTHS) if on else None)
    if not on:
        return cost
    cost.widths = WIDTHS
    for ctx, kind in zip(contexts, ("target", "draft")):
        if ctx is not None and not isinstance(ctx, backend.HeadContext):
            ctx.pad_width = partial(cost.pad_to, kind=kind)
    return cost


class Engine:
    """Loaded models, the shared contexts and their slots, the shared cost model and acceptance
    prior. Confined to one thread (the daemon's engine thread)."""

    def __init__(self, cfg: EngineConfig, target: backend.Model, draft: backend.Model | None, slots: list[Slot],
                 contexts: tuple = (), draft_kind: str | None = None, head: backend.Model | None = None):
        self.cfg = cfg
        self.target = target
        self.draft = draft
        # how a draft model speaks the target's vocabulary (backend.Pairing, or TextPairing: through text)
        self.pairing = None
        self.head = head  # an EAGLE-3 head beside the draft model (EngineConfig.head), or None
        self._contexts = contexts  # (target context, draft context or None[, head context])
        # "model" (a draft model), "text" (one with another tokenizer), "eagle3" (a head over the
        # target's features) or None
        self.draft_kind = (draft_kind or "model") if draft is not None else None
        # the drafters a request may draft with: the draft's kind, and "eagle3" with a head beside it
        self.drafter_kinds: tuple[str, ...] = ((self.draft_kind,) if self.draft_kind else ()) + \
            (("eagle3",) if head is not None else ())

        self.controller_cfg = ControllerConfig()
        self.cost = pad_forwards(CostModel(), contexts, cfg)  # a GPU's forwards at fixed widths
        # each drafter's acceptance, learnt across the requests that drafted with it
        self.priors = {k: AcceptancePrior() for k in self.drafter_kinds or ("model",)}
        self.prior = self.priors[self.drafter_kinds[0] if self.drafter_kinds else "model"]
        self.drafter_choice = DrafterChoice()  # which drafter a request drafts with (two loaded)
        self.draft_verdicts: dict[str, dict] = {}  # cost curve -> economics.drafter_verdict at calibration
        self.goodput = GoodputGuard()  # auto falls back to plain where speculating measured slower
        # the target's and draft's CPU threads: the configured count or one (controller/threads.py)
        self.threads = ThreadGovernor(cfg.target.n_threads,
                                      enabled=all(hasattr(c, "set_threads") for c in contexts if c is not None)
                                      and cfg.target.n_gpu_layers == 0)
        self._threads_applied = cfg.target.n_threads
        self.last_tick = None  # the last tick's TickRecord (edgespec/tick/observe.py)
        self._compiler = None  # the grammar compiler for this vocabulary, made on first use
        self._compiler_lock = threading.Lock()
        self.tick_totals: dict[str, float] = {}  # seconds per tick phase, ticks, ... since load
        # the cross-request suffix cache (drafters/suffix.py): replies of finished requests that
        # speculated, drafted from by the next ones (partitioned by caller unless pooled)
        self.suffix_cache = SuffixCache(cfg.suffix_cache_bytes, cfg.suffix_cache_store,
                                        pooled=cfg.suffix_cache_scope == "pooled")
        self.suffix_enabled = cfg.suffix_cache
        # what prompt lookups achieved in recent requests, in the suffix cache's partitions: the
        # reach each new request's lookups start from (drafters/ngram.py)
        self.lookup_priors = ReachPriors()
        # kept prefills beyond the slots' own, in host memory (edgespec/prompt_store.py)
        store = PromptStore(cfg.prompt_cache_bytes, pooled=cfg.prompt_cache_scope == "pooled") \
            if cfg.prompt_cache and cfg.prompt_cache_bytes and not target.n_swa else None
        # the slots, where each request sits and what it keeps of earlier ones (edgespec/slots.py)
        self.pool = SlotPool(self, slots, store)

    @property
    def slots(self) -> list[Slot]:
        return self.pool.slots

    @property
    def prompt_store(self) -> PromptStore | None:
        return self.pool.prompt_store

    @prompt_store.setter
    def prompt_store(self, store: PromptStore | None) -> None:
        self.pool.prompt_store = store

    # -- lifecycle ----------------------------------------------------------------------------
    @classmethod
    def load(cls, cfg: EngineConfig, controller_cfg=None, calibrate: bool = True) -> Engine:
        cfg.validate()
        # on a CPU the target's weights keep their file layout: ggml's repacked layouts round a
        # batched product differently from a one-token one (backend.Model); drafts need no exactness.
        # [target] fast_kernels trades that for llama.cpp's speed (and the tiled K-quant kernel,
        # read once per process by ggml: set before the first forward)
        if cfg.fast_kernels:
            os.environ["GGML_CPU_TILED_MM"] = "1"
        target = backend.Model(cfg.target.path, cfg.target.n_gpu_layers,
                               repack=cfg.target.n_gpu_layers != 0 or cfg.fast_kernels)
        draft = head = second = pairing = None
        if cfg.draft is not None:
            draft = backend.Model(cfg.draft.path, cfg.draft.n_gpu_layers)
            if draft_kind(backend.model_arch(draft)) == "eagle3":
                backend.check_head(target, draft)
                head = draft
            else:
                pairing = backend.pair(target, draft)  # another tokenizer: a text draft (drafters/text.py)
        if cfg.head is not None and head is None and draft is not None:
            second = backend.Model(cfg.head.path, cfg.head.n_gpu_layers)
            if draft_kind(backend.model_arch(second)) != "eagle3":
                second.close()
                raise BadRequest("draft.head", f"{cfg.head.path} is not an EAGLE-3 head (its GGUF architecture "
                                 "is not eagle3)")
            backend.check_head(target, second)
        n_seq = seqs_per_slot(cfg.parallel, cfg.max_tree_leaves)
        cells = shared_cells(cfg.parallel, cfg.target.n_ctx)
        features = head if head is not None else second
        if features is not None:
            tctx = backend.FeatureContext(target, cfg.target, backend.target_layer_ids(features),
                                          n_seq_max=cfg.parallel * n_seq, n_ctx=cells)
        else:
            tctx = backend.Context(target, cfg.target, n_seq_max=cfg.parallel * n_seq, n_ctx=cells)
        dctx = None
        if head is not None:  # the head holds each request's whole context, as the target does
            dctx = backend.HeadContext(head, tctx, cfg.draft, n_seq_max=cfg.parallel * n_seq, n_ctx=cells)
        elif draft is not None:
            dctx = backend.Context(draft, cfg.draft, n_seq_max=cfg.parallel * n_seq,
                                   n_ctx=shared_cells(cfg.parallel, cfg.draft.n_ctx))
            if isinstance(pairing, backend.Pairing):
                dctx.speak_target_vocab(pairing)
        hctx = None
        if second is not None:  # the head beside the draft model holds each request's whole context too
            hctx = backend.HeadContext(second, tctx, cfg.head, n_seq_max=cfg.parallel * n_seq, n_ctx=cells)
        slots = []
        for i in range(cfg.parallel):
            t = SeqRange(tctx, i * n_seq, n_seq, cfg.target.n_ctx)
            d = h = None
            if dctx is not None:
                d = SeqRange(dctx, i * n_seq, n_seq, cfg.target.n_ctx if head is not None else cfg.draft.n_ctx)
            if hctx is not None:
                h = SeqRange(hctx, i * n_seq, n_seq, cfg.target.n_ctx)
            slots.append(Slot(i, t, d, h))
        contexts = (tctx, dctx) if hctx is None else (tctx, dctx, hctx)
        kind = "eagle3" if head is not None else "text" if isinstance(pairing, backend.TextPairing) else "model"
        eng = cls(cfg, target, draft, slots, contexts, kind, head=second)
        eng.pairing = pairing
        if controller_cfg is not None:
            eng.controller_cfg = controller_cfg
        if calibrate:
            eng.calibrate()
        log.info("engine_loaded", target=str(cfg.target.path), draft=str(cfg.draft.path) if cfg.draft else None,
                 head=str(cfg.head.path) if second is not None else None, slots=cfg.parallel, seqs_per_slot=n_seq,
                 backend=eng.backend_name, **({"pairing": pairing.describe()} if pairing is not None else {}))
        log.info("exactness", promise=eng.exactness(), **({"sliding_window": target.n_swa} if target.n_swa else {}))
        for kind, v in eng.draft_verdicts.items():
            log.info("draft_economics", drafter=kind, **v, **({} if v["pays"] else {
                "hint": "no chain of this drafter pays on this box even at the acceptance shown: auto requests "
                        "draft from prompt n-grams and the suffix cache only (`edgespec plan --measure` shows "
                        "the table); a cheaper draft or a faster box changes that"}))
        if draft is None:
            log.info("model_free_drafting", hint="no draft model: requests draft from prompt n-grams and the suffix "
                     "cache; to draft with a model set [draft] path to a small model of the target's family (its "
                     "tokenizer; a padded vocabulary is fine; one with another tokenizer drafts through text); "
                     "`edgespec plan --draft FILE` checks the pair")
        return eng

    # what the engine applies beyond plain generation (the daemon refuses the others)
    capabilities = frozenset({"constraint", "logprobs"})

    def constraint_matcher(self, spec):
        """A grammar state for one request (edgespec/constraint.py); BadRequest naming the field
        when the constraint does not compile."""
        return self.compile_constraint(spec)

    def compile_constraint(self, spec):
        """constraint_matcher from any thread: the daemon compiles each request's constraint in
        its handler thread (GenerationRequest.matcher), so that neither a large schema, regex or
        grammar (llguidance drops the GIL while it compiles) nor the first request's reading of the
        whole vocabulary stalls the engine thread, which decodes every caller's requests."""
        from edgespec import budget
        from edgespec.constraint import Compiler, Vocabulary

        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = Compiler(Vocabulary.from_model(self.target))
        return budget.matcher(self._compiler, spec)

    @property
    def features(self) -> bool:
        """Whether target forwards hand their features to the drafters (an EAGLE-3 head)."""
        return "eagle3" in self.drafter_kinds

    @property
    def prompt_cache(self) -> bool:
        """Slots keep prefills for the next request. With a head the slot keeps the head's
        positions too, and a request keeps no more of the target's prefill than of the head's:
        the head needs the target's features of every context token it has not absorbed, and a
        kept prefill's are not computed again (drafters/eagle3.py). Not for a sliding-window
        target: llama.cpp reuses (and a state copy leaves out) the cells a window masks for the
        sequence's last position, which a shorter prompt's next token may still need."""
        return self.cfg.prompt_cache and not self.target.n_swa

    def new_drafter(self, slot: Slot, kind: str | None = None):
        """The drafter of one request on `slot` (drafters/base.py: Drafter): `kind` ("model",
        "eagle3"; default the draft's)."""
        kind = kind or self.draft_kind
        models = {"target": self.target, "draft": self.draft} if kind == "text" else {}
        return drafter_class(kind)(slot.drafter_range(kind), window=self.cfg.draft_window, **models)

    def cost_kind(self, kind: str | None) -> str:
        """The cost model's curve that prices drafter `kind`: "head" for a head beside the draft
        model, else "draft" (the one drafter's forwards, a model's or a head's)."""
        return "head" if kind == "eagle3" and self.head is not None else "draft"

    def choose_drafter(self, req: GenerationRequest, slots: dict | None = None) -> str | None:
        """The drafter `req` drafts with: the only one, or with a head beside the draft model, the
        one that promises the request more at the load it joins, its one-off costs on the slot it
        would get (`slots`: drafter -> slot) included (controller/drafter_choice.py); a plain
        request takes the draft model (no head limits what it keeps of a prompt)."""
        kinds = self.drafter_kinds
        if len(kinds) < 2:
            return kinds[0] if kinds else None
        if req.speculation.mode == "plain":
            return kinds[0]
        busy = [s for s in self.slots if s.busy]
        sharing = {k: sum(1 for s in busy if s.drafting == k) for k in kinds}
        options = {k: (self.priors[k], self.cost.drafting(self.cost_kind(k))) for k in kinds}
        once = None
        if slots:  # what each costs once beyond the cheaper one
            once = {k: self._once_seconds(req, slots[k], k) for k in kinds}
            least = min(once.values())
            once = {k: v - least for k, v in once.items()}
        return self.drafter_choice.choose(options, load=len(busy) + 1, sharing=sharing,
                                          tokens=req.sampling.max_tokens, once=once)

    def _once_seconds(self, req: GenerationRequest, slot: Slot, kind: str) -> float:
        """What drafting `req` with `kind` on `slot` costs before its first proposal, beyond what
        the other drafter would: the prompt prefill the target computes again (a head keeps no
        more of the prefill than the head positions it can hold: SlotPool.kept_prefill) and the drafter's
        catch-up over the prompt tokens it does not hold (a draft model over its window at most)."""
        prompt = req.prompt_tokens
        cost = self.cost.drafting(self.cost_kind(kind))
        keep, _, hdonor = self.pool.kept_prefill(slot, req, kind)
        prefill = len(prompt) - 1 - keep
        if hdonor is not None:  # the head's positions and features come from another slot
            cache = hdonor.head_to_lend(kind)
        else:
            cache = slot.cache_of(kind) if self.prompt_cache and self.pool.shares(slot, req) else None
        held = cache.reusable(prompt) if cache is not None else 0
        backlog = max(1, len(prompt) - 1 - held)
        if kind == "model":
            backlog = min(backlog, self.cfg.draft_window)
        return cost.verify_seconds(max(1, prefill)) + cost.draft_seconds(backlog)

    def new_controller(self, req: GenerationRequest, slot: Slot, kind: str | None = None):
        """The speculation controller of one auto request on `slot` (edgespec/controller/), pricing
        and judging drafter `kind` (its cost curve and acceptance prior)."""
        spec = req.speculation
        kind = kind or self.draft_kind
        has_draft = kind is not None and slot.drafter_range(kind) is not None and self.drafter_pays(kind)
        return Controller(self.controller_cfg, self.cost.drafting(self.cost_kind(kind)),
                          self.priors.get(kind, self.prior), max_depth=spec.tree_depth,
                          max_nodes=spec.tree_nodes, has_draft_model=has_draft,
                          max_leaves=slot.target.n_seq_max, request_id=req.request_id, refine_costs=False)

    def drafter_pays(self, kind: str) -> bool:
        """Whether calibration found a chain of drafter `kind` ("model", "eagle3") that pays on this
        box (economics.drafter_verdict); true before calibration and for an unjudged drafter."""
        v = self.draft_verdicts.get(self.cost_kind(kind))
        return v is None or bool(v["pays"])

    def new_suffix_drafter(self, req: GenerationRequest) -> SuffixDrafter | None:
        """A request's view of the suffix cache: None when the cache is off, or the request does
        not speculate (plain mode) or opts out; such a request does not feed the cache either."""
        if not self.suffix_enabled or req.speculation.mode == "plain" or not req.speculation.suffix:
            return None
        return SuffixDrafter(self.suffix_cache, req.caller)

    def suffix_control(self, enabled: bool | None = None, clear: bool = False) -> dict:
        """Turn the suffix cache on or off (off empties it) and/or empty it (SetPolicy, SIGHUP);
        returns its stats."""
        if enabled is not None:
            self.suffix_enabled = bool(enabled)
        if clear or not self.suffix_enabled:
            self.suffix_cache.clear()
        if clear:
            self.lookup_priors.clear()
        return self.suffix_stats()

    def suffix_stats(self) -> dict:
        return {"enabled": self.suffix_enabled, **self.suffix_cache.stats()}

    @property
    def target_ctx(self) -> backend.Context:
        return self._contexts[0]

    @property
    def draft_ctx(self) -> backend.Context | None:
        return self._contexts[1]

    @property
    def head_ctx(self) -> backend.Context | None:
        """The head's context beside the draft model's (EngineConfig.head), or None."""
        return self._contexts[2] if len(self._contexts) > 2 else None

    @property
    def batch_invariant(self) -> bool:
        """Whether every forward gives each token the bits it would get alone, whatever the batch
        and wherever its cells sit: a CPU with the patched ggml (tools/patches/) and flash
        attention, for the weight types of backend.EXACT_CPU_TYPES (F32, Q8_0, Q4_0/1, Q5_0/1 and
        the Q3_K-Q6_K K-quants). Then a kept prefill is reusable at any length."""
        return (self.backend_name == "cpu" and self.target_ctx.abortable and self.cfg.target.flash_attn
                and not (self.cfg.fast_kernels and self.target.weight_types & backend.REPACKED_TYPES)
                and self.target.weight_types <= backend.exact_cpu_types())

    def exactness(self) -> str:
        """What the appliance promises of this target's outputs, and if less than bits, why."""
        types = ", ".join(sorted(self.target.weight_types))
        if self.batch_invariant:
            return f"bit-exact: each token's logits are its one-token forward's at any batch ({types})"
        why = []
        if self.backend_name != "cpu":
            why.append(f"{self.backend_name} kernels vary with the batch")
        if not self.target_ctx.abortable:
            why.append("libllama without the batch-invariant patch")
        if not self.cfg.target.flash_attn:
            why.append("flash_attn off")
        if self.cfg.fast_kernels and self.target.weight_types & backend.REPACKED_TYPES:
            why.append("target.fast_kernels: repacked weights")
        other = sorted(self.target.weight_types - backend.exact_cpu_types())
        if other:
            why.append("weight types without batch-invariant CPU kernels: " + ", ".join(other))
        return "up to float rounding (" + "; ".join(why) + "): selftest and [audit] measure it"

    @property
    def reuse_chunk(self) -> int:
        """The granularity at which a slot's kept prefill is reusable (reusable_prefix)."""
        return 1 if self.batch_invariant else self.cfg.target.n_batch

    def abort_forward(self) -> None:
        """Stop the forward in progress at its next graph node (callable from any thread): the
        tick raises backend.ForwardAborted, and its sessions must be closed. The flag holds until
        the next tick starts."""
        for ctx in self._contexts:
            if ctx is not None:
                ctx.abort()

    @property
    def threads_now(self) -> int:
        """The thread count the current tick's forwards use (the governor's last choice)."""
        return self._threads_applied

    @property
    def backend_name(self) -> str:
        return "cuda" if (self.cfg.target.n_gpu_layers != 0 and backend.gpu_offload_supported()) else "cpu"

    def calibrate(self, sizes: Sequence[int] = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64), repeats: int = 3,
                  budget_seconds: float = 0.25) -> None:
        """Time target and draft forwards per batch size on slot 0, so the controller's cost model
        describes this machine. The sizes are those up to CALIBRATE_AT_LEAST, then those whose
        first timing, in increasing order, fits in `budget_seconds` per model; then `repeats - 1`
        more rounds over all of them, and each size keeps its fastest. Rounds, not repeats in a
        row: a slow moment (another tenant, the page cache still filling after load) then
        inflates one timing of every size instead of every timing of the first sizes. A batched
        tick's forwards hold several sessions' tokens, so the sizes reach past one tree's. With
        an EAGLE-3 head the draft's curve is the head's forwards (its g inputs zeros: the same
        work), which is how the controller prices the head like any drafter; a head beside the
        draft model gets a curve of its own ("head"). Each curve is fitted on the sizes it was
        timed at."""
        slot = self.slots[0]
        head = slot.drafter_range("eagle3") if self.features else None

        def forward(ctx, n: int, start: int, out: list[bool]) -> None:
            toks, pos = [self.target.bos] * n, list(range(start, start + n))
            if head is not None and ctx is head:  # the head's shared context, in global seq ids
                decode_batch(ctx.ctx, toks, pos, [ctx.to_global((0,))] * n, out,
                             np.zeros((n, ctx.ctx.n_embd), np.float32))
            else:
                ctx.decode_rows(toks, pos, [(0,)] * n, out)

        def measure(ctx, n: int, all_logits: bool = False) -> float:
            # as the steps use them: verification needs every token's logits, a draft catch-up the
            # last token's only (the output head's rows are a real share of a small draft's forward)
            out = [True] * n if ctx is slot.target or all_logits else [False] * (n - 1) + [True]
            t0 = time.perf_counter()
            forward(ctx, n, 32, out)
            dt = time.perf_counter() - t0
            ctx.seq_rm(0, 32, -1)
            return dt

        ranges = {"target": slot.target, "draft": slot.draft, "head": slot.head}
        kinds = tuple(k for k in ("target", "draft", "head") if ranges[k] is not None)
        table: dict[str, dict[int, float]] = {}
        for kind in kinds:
            ctx = ranges[kind]
            ctx.clear()
            forward(ctx, 32, 0, [False] * 32)  # a short prefix
            for _ in range(2):
                measure(ctx, 4)  # warm-up: the first decodes allocate buffers and fault pages in
            spent, table[kind] = 0.0, {}
            for n in (s for s in sizes if s <= self.cfg.target.n_batch):
                if spent > budget_seconds and max(table[kind], default=0) >= CALIBRATE_AT_LEAST:
                    break  # the cost model extrapolates linearly beyond the last size
                table[kind][n] = measure(ctx, n)
                spent += table[kind][n]
            for _ in range(repeats - 1):
                for n in table[kind]:
                    table[kind][n] = min(table[kind][n], measure(ctx, n))
        rows = {}
        for kind in kinds[1:]:
            n = max((k for k in table[kind] if k <= 4), default=1)
            if n > 1:  # what each extra output row (a tree expansion's) adds to the catch-up timed above
                every = min(measure(ranges[kind], n, all_logits=True) for _ in range(repeats))
                rows[kind] = (every - table[kind][n]) / (n - 1)
        for kind in kinds:  # each on the sizes it was timed at (a slow draft model reaches fewer)
            self.cost.calibrate(lambda k, n: table[k][n], sizes=tuple(sorted(table[kind])), kinds=(kind,),
                                draft_row=rows or None, context=32)
        # will each drafter pay on this box (plan --measure's arithmetic on these timings)?
        self.draft_verdicts = {k: v for k in kinds[1:] if 1 in table[k] and
                               (v := drafter_verdict(table["target"], table[k][1], (JUDGED_AT,))) is not None}
        for s in self.slots:
            s.reset()

    def warmup(self) -> None:
        toks = self.tokenize("Hello")
        self.generate(GenerationRequest(tuple(toks), SamplingParams(max_tokens=2)))

    def close(self) -> None:
        for ctx in self._contexts:
            if ctx is not None:
                ctx.close()
        self.target.close()
        for m in (self.draft, self.head):
            if m is not None:
                m.close()

    # -- text ---------------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        """The most tokens one request may hold (the shared context holds every slot's)."""
        return self.slots[0].target.n_ctx

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.target.tokenize(text, add_special, parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.target.detokenize(ids)

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> str:
        return self.target.chat_prompt(messages)

    @property
    def special_tokens(self) -> Mapping[str, int]:
        return self.target.special_tokens  # with tokenize and chat_prompt: a chat.ChatTokenizer

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Chat template -> tokens: special tokens from the template only (edgespec.chat)."""
        return chat.encode_chat(self.target, messages)

    @property
    def encoder(self) -> backend.Model:
        """The target's vocabulary and chat template, safe to use from any thread (tokenize and
        chat_prompt only read the loaded model): the daemon tokenises in its handler threads."""
        return self.target

    def model_info(self) -> dict:
        t, d, h = self.target, self.draft, self.head

        def info(m):
            return None if m is None else {"path": str(m.path), "desc": m.desc, "n_params": m.n_params,
                                           "size_bytes": m.size_bytes}

        return {
            "target": info(t),
            "draft": info(d),
            **({"head": info(h)} if h is not None else {}),
            "n_vocab": t.n_vocab,
            **({"pairing": self.pairing.describe()} if self.pairing is not None else {}),
            "exactness": self.exactness(),
            **({"draft_economics": dict(self.draft_verdicts)} if self.draft_verdicts else {}),
            **({"sliding_window": f"{t.n_swa} tokens: a full-size window cache, tree verification, prompt "
                "reuse off"} if t.n_swa else {}),
            "n_ctx": self.n_ctx, "parallel": len(self.slots),
            "backend": self.backend_name, "pad_forwards": self.cost.widths is not None,
        }

    def next_logits(self, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray | None]:
        """Target and draft logits for the token after `tokens` (uses a free slot; for selftest)."""
        slot = next((s for s in self.slots if not s.busy), None)
        if slot is None:
            raise Overloaded("no free slot")
        out = []
        for ctx in (slot.target, None if self.draft_kind in ("eagle3", "text") else slot.draft):
            if ctx is None:
                out.append(None)
                continue
            ctx.clear()
            ctx.decode_seq(list(tokens), 0, (0,), last_logits=True)
            out.append(ctx.logits(-1).copy())
            ctx.clear()
        slot.prefill = ()
        slot.draft_cache = slot.head_cache = None
        return out[0], out[1]

    # -- sessions -----------------------------------------------------------------------------
    def idle_work(self, budget: int = 16) -> bool:
        """Bring a free slot's draft up to its last context in idle time (SlotPool.idle_work)."""
        return self.pool.idle_work(budget)

    def abort_idle_work(self, on: bool = True) -> None:
        """From any thread: stop idle work's draft forward at its next graph node (`idle_work`
        then returns False, the draft keeping what it held before the piece), so that a request
        arriving during idle time starts at once instead of after the piece. `on=False` lowers the
        flag again (the engine thread, once idle work has returned)."""
        ctx = self.draft_ctx
        if ctx is not None:
            ctx.abort() if on else ctx.clear_abort()

    @property
    def free_slots(self) -> int:
        return self.pool.free

    def open_session(self, req: GenerationRequest) -> Session:
        """Admit a request to a free slot. No forward runs here: the ticks prefill its prompt in
        pieces (so a long prompt never stalls the sessions already decoding)."""
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
        bad = [t for t, _ in req.sampling.logit_bias if t >= self.target.n_vocab]
        if bad:
            raise BadRequest(f"logit_bias.{bad[0]}", f"token id outside [0, {self.target.n_vocab})")
        places = self.pool.places(req)
        kind = self.choose_drafter(req, places)
        slot = places[kind]
        keep = self.pool.take(slot, req, kind)
        try:
            sess = Session(self, slot, req, keep=keep, drafter=kind)
            if len(self.drafter_kinds) > 1 and req.speculation.mode != "plain":
                # which drafter each request that may draft drafts with (Admin.Stats, /metrics)
                key = f"drafter_requests_{self.cost_kind(kind)}"
                self.tick_totals[key] = self.tick_totals.get(key, 0) + 1
                for k, v in self.drafter_choice.last.items():
                    self.tick_totals[f"drafter_estimate_{self.cost_kind(k)}"] = v
            return sess
        except BaseException:
            slot.busy = False
            raise

    def release(self, sess: Session) -> None:
        """A session ends: its slot keeps what is reusable (the prompt prefill's chunks, the draft's
        context), or is emptied."""
        if sess.controller is not None:
            try:
                self.priors.get(sess.drafter_kind, self.prior).update_from(sess.controller.evidence())
            except Exception:  # the prior is an optimisation; never fail a request on it
                log.warning("prior_update_failed", exc_info=True)
            sess.controller = None
        if sess.suffix is not None and sess.out and self.suffix_enabled:
            # what it emitted (any finish: every token is the target's) feeds the next requests' drafts
            self.suffix_cache.insert(sess.suffix.caller, sess.tokens[:sess.n_prompt], sess.out)
            sess.suffix = None
        self.pool.give_back(sess)

    def tick(self, sessions: Sequence[Session]) -> dict[Session, Chunk]:
        """One engine tick over the active sessions (edgespec/tick/): every decoding session's
        [root] + tree in one target forward, prefill pieces alongside. Returns each session's
        chunk (an empty one while it is still prefilling)."""
        for ctx in self._contexts:
            if ctx is not None:
                ctx.clear_abort()
        n = self.threads.choose()
        if n != self._threads_applied:
            for ctx in self._contexts:
                if ctx is not None:
                    ctx.set_threads(n)
            self._threads_applied = n
        try:
            return run_tick(self, list(sessions))
        except ForwardAborted:
            for s in sessions:  # llama.cpp dropped part of the forward's cells: nothing is kept
                s.abandon()
            raise

    def generate(self, req: GenerationRequest) -> GenerationResult:
        sess = self.open_session(req)
        try:
            while not sess.done:
                self.tick([sess])
            return sess.result()
        finally:
            sess.close()

