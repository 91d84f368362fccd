"""Loading the models and calibrating the cost model: how an Engine comes to be, and what its
models are and promise (`LoadedModels`, the engine's base).

`read_models` reads the target and the draft and checks that they speak one vocabulary;
`make_contexts` makes the shared contexts (one target context, one draft context, a head's) and
`make_slots` cuts them into slots (edgespec/slots.py); `Engine.load` (edgespec/engine.py) runs
them in that order. The draft is a draft model or an EAGLE-3 head (a `[draft] path` whose GGUF
architecture is `eagle3`, detected at load): then the target context is a FeatureContext (its
features go to each session's head drafter after every target forward) and the shared draft
context is the head's (backend.HeadContext), with the same slot ranges. Both at once
(`EngineConfig.head` beside a draft model): the engine holds the draft model's context and the
head's, each slot a range in both; each drafter keeps its own acceptance prior and cost curve.

`calibrate` times target and draft forwards per batch size on slot 0, so the controller's cost
model describes this machine.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from edgespec import backend, chat
from edgespec.config import EngineConfig, shared_cells
from edgespec.drafters import draft_kind
from edgespec.drafters.base import decode_batch
from edgespec.economics import drafter_verdict
from edgespec.errors import BadRequest
from edgespec.kv import SeqRange
from edgespec.logs import get_logger
from edgespec.pairing import Pairing, TextPairing
from edgespec.slots import Slot
from edgespec.types import ConstraintSpec

if TYPE_CHECKING:
    from edgespec.budget import BudgetMatcher
    from edgespec.constraint import Compiler, Matcher
    from edgespec.controller import CostModel

log = get_logger("edgespec.engine")

# a drafter is left idle when no chain of it pays even at this per-token acceptance (a good draft's:
# the demo's Q8_0 twin reaches 0.9-0.95, real 3-5 % drafts 0.6-0.8), so a noisy calibration does
# not idle a draft that would pay
JUDGED_AT = 0.9
# calibration times every size up to this one whatever its budget: a tick of 8 sessions verifies
# 8 to 40 tokens, and a curve extrapolated from sizes 1-4 priced each of them at the 3-to-4 slope
CALIBRATE_AT_LEAST = 32
# a table whose size costs this much more than a larger one is jagged (a CPU's K-quant and Q4_0
# kernels take 4, 8 or 16 tokens at a time: on the 1B-cost demo T(3) is 1.4x T(4), T(15) 1.3x
# T(16)); calibration then also times these sizes (those it reached), so that every width a tick
# of several sessions runs at is priced at its own time and `pad_to` pads where it pays, instead
# of interpolating between two sizes that sit on either side of a step
JAGGED = 1.05
JAGGED_FILL = (*range(1, 17), 20, 24, 28)

# a context the engine holds: the target's (a FeatureContext under a head), a draft model's, a head's
AnyContext = backend.Context | backend.HeadContext


class LoadedModels:
    """The loaded models and their shared contexts: the target's vocabulary and chat template,
    what its forwards promise (exactness), and the contexts' abort flags. The engine's base:
    what it knows of its models, apart from how it serves requests with them."""

    def __init__(self, cfg: EngineConfig, target: backend.Model, draft: backend.Model | None,
                 contexts: tuple[AnyContext | None, ...] = (), draft_kind: str | None = None, head: backend.Model | None = None):
        self.cfg = cfg
        self.target = target
        self.draft = draft
        # how a draft model speaks the target's vocabulary (backend.Pairing, or TextPairing: through text)
        self.pairing: Pairing | TextPairing | None = None
        self.head = head  # an EAGLE-3 head beside the draft model (EngineConfig.head), or None
        self._contexts = contexts  # (target context, draft context or None[, head context])
        # "model" (a draft model), "text" (one with another tokenizer), "eagle3" (a head over the
        # target's features) or None
        self.draft_kind = (draft_kind or "model") if draft is not None else None
        # the drafters a request may draft with: the draft's kind, and "eagle3" with a head beside it
        self.drafter_kinds: tuple[str, ...] = ((self.draft_kind,) if self.draft_kind else ()) + \
            (("eagle3",) if head is not None else ())
        # cost curve ("draft", "head") -> economics.drafter_verdict at calibration (calibrate)
        self.draft_verdicts: dict[str, dict[str, Any]] = {}
        self._compiler: Compiler | None = None  # the grammar compiler for this vocabulary, made on first use
        self._compiler_lock = threading.Lock()

    # what the engine applies beyond plain generation (the daemon refuses the others)
    capabilities = frozenset({"constraint", "logprobs"})

    def constraint_matcher(self, spec: ConstraintSpec) -> Matcher | BudgetMatcher:
        """A grammar state for one request (edgespec/constraint.py); BadRequest naming the field
        when the constraint does not compile."""
        return self.compile_constraint(spec)

    def compile_constraint(self, spec: ConstraintSpec) -> Matcher | BudgetMatcher:
        """constraint_matcher from any thread: the daemon compiles each request's constraint in
        its handler thread (GenerationRequest.matcher), so that neither a large schema, regex or
        grammar (llguidance drops the GIL while it compiles) nor the first request's reading of the
        whole vocabulary stalls the engine thread, which decodes every caller's requests."""
        from edgespec import budget
        from edgespec.constraint import Compiler, MaskLimits, Vocabulary

        cfg = self.cfg
        with self._compiler_lock:
            if self._compiler is None:
                limits = MaskLimits(cfg.constraint_step_seconds, cfg.constraint_tick_seconds,
                                    cfg.constraint_burst_seconds, cfg.constraint_share, cfg.constraint_wait_seconds)
                self._compiler = Compiler(Vocabulary.from_model(self.target), limits)
        return budget.matcher(self._compiler, spec)

    def cost_kind(self, kind: str | None) -> str:
        """The cost model's curve that prices drafter `kind`: "head" for a head beside the draft
        model, else "draft" (the one drafter's forwards, a model's or a head's)."""
        return "head" if kind == "eagle3" and self.head is not None else "draft"

    def drafter_pays(self, kind: str) -> bool:
        """Whether calibration found a chain of drafter `kind` ("model", "eagle3") that pays on this
        box (economics.drafter_verdict); true before calibration and for an unjudged drafter."""
        v = self.draft_verdicts.get(self.cost_kind(kind))
        return v is None or bool(v["pays"])

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

    @property
    def target_ctx(self) -> backend.Context:
        return cast("backend.Context", self._contexts[0])

    @property
    def draft_ctx(self) -> AnyContext | None:
        return self._contexts[1]

    @property
    def head_ctx(self) -> AnyContext | None:
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
    def backend_name(self) -> str:
        return "cuda" if (self.cfg.target.n_gpu_layers != 0 and backend.gpu_offload_supported()) else "cpu"

    def close(self) -> None:
        for ctx in self._contexts:
            if ctx is not None:
                ctx.close()
        self.target.close()
        for m in (self.draft, self.head):
            if m is not None:
                m.close()

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
        return chat.encode_chat(cast("chat.ChatTokenizer", self.target), messages)

    @property
    def encoder(self) -> backend.Model:
        """The target's vocabulary and chat template, safe to use from any thread (tokenize and
        chat_prompt only read the loaded model): the daemon tokenises in its handler threads."""
        return self.target

    def abort_idle_work(self, on: bool = True) -> None:
        """From any thread: stop idle work's draft forward at its next graph node (`idle_work`
        then returns False, the draft keeping what it held before the piece), so that a request
        arriving during idle time starts at once instead of after the piece. `on=False` lowers the
        flag again (the engine thread, once idle work has returned)."""
        ctx = self.draft_ctx
        if ctx is not None:
            ctx.abort() if on else ctx.clear_abort()



@dataclass
class Models:
    """What load reads: the target, the draft (a model or a head) and a head beside a draft model."""

    target: backend.Model
    draft: backend.Model | None = None
    head: backend.Model | None = None  # the draft, when it is an EAGLE-3 head
    second: backend.Model | None = None  # a head beside the draft model (EngineConfig.head)
    pairing: Pairing | TextPairing | None = None

    @property
    def kind(self) -> str:
        """The draft's kind: "eagle3" (a head), "text" (another tokenizer) or "model"."""
        return "eagle3" if self.head is not None else "text" if isinstance(self.pairing, TextPairing) \
            else "model"


def read_models(cfg: EngineConfig) -> Models:
    """Load the target and the draft, and check that they speak one vocabulary (or pair through
    text); a head beside the draft model must be an EAGLE-3 head over the target."""
    # on a CPU the target's weights are repacked only where the patched kernels keep every token's
    # bits whatever the batch (backend.target_repack: Q4_0 and Q4_K with
    # ggml-repack-invariant.patch); drafts need no exactness. [target] fast_kernels trades
    # exactness for llama.cpp's own kernels (and the tiled K-quant kernel, read once per process
    # by ggml: set before the first forward)
    if cfg.fast_kernels:
        os.environ["GGML_CPU_TILED_MM"] = "1"
    m = Models(backend.Model(cfg.target.path, cfg.target.n_gpu_layers,
                             repack=backend.target_repack(cfg.target.path, cfg.target.n_gpu_layers,
                                                          cfg.fast_kernels)))
    if cfg.draft is not None:
        m.draft = backend.Model(cfg.draft.path, cfg.draft.n_gpu_layers)
        if draft_kind(backend.model_arch(m.draft)) == "eagle3":
            backend.check_head(m.target, m.draft)
            m.head = m.draft
        else:
            m.pairing = backend.pair(m.target, m.draft)  # another tokenizer: a text draft (drafters/text.py)
    if cfg.head is not None and m.head is None and m.draft is not None:
        m.second = backend.Model(cfg.head.path, cfg.head.n_gpu_layers)
        if draft_kind(backend.model_arch(m.second)) != "eagle3":
            m.second.close()
            raise BadRequest("draft.head", f"{cfg.head.path} is not an EAGLE-3 head (its GGUF architecture "
                             "is not eagle3)")
        backend.check_head(m.target, m.second)
    return m


def make_contexts(cfg: EngineConfig, m: Models, n_seq: int) -> tuple[AnyContext | None, ...]:
    """The shared contexts, each of `cfg.parallel * n_seq` sequences: (target, draft or None[, head
    beside the draft model])."""
    n_seq_max = cfg.parallel * n_seq
    cells = shared_cells(cfg.parallel, cfg.target.n_ctx)
    features = m.head if m.head is not None else m.second
    tctx: backend.Context
    if features is not None:
        tctx = backend.FeatureContext(m.target, cfg.target, backend.target_layer_ids(features),
                                      n_seq_max=n_seq_max, n_ctx=cells)
    else:
        tctx = backend.Context(m.target, cfg.target, n_seq_max=n_seq_max, n_ctx=cells)
    dctx: AnyContext | None = None
    if m.head is not None and cfg.draft is not None:  # the head holds each request's whole context, as the target does
        dctx = backend.HeadContext(m.head, tctx, cfg.draft, n_seq_max=n_seq_max, n_ctx=cells)
    elif m.draft is not None and cfg.draft is not None:
        dctx = backend.Context(m.draft, cfg.draft, n_seq_max=n_seq_max,
                               n_ctx=shared_cells(cfg.parallel, cfg.draft.n_ctx))
        if isinstance(m.pairing, Pairing):
            dctx.speak_target_vocab(m.pairing)
    if m.second is None or cfg.head is None:
        return tctx, dctx
    # the head beside the draft model holds each request's whole context too
    return tctx, dctx, backend.HeadContext(m.second, tctx, cfg.head, n_seq_max=n_seq_max, n_ctx=cells)


def make_slots(cfg: EngineConfig, contexts: tuple[AnyContext | None, ...], n_seq: int, head: bool) -> list[Slot]:
    """Slot i: sequences [i * n_seq, (i + 1) * n_seq) of every context. `head`: the draft context
    is a head's (it holds each request's whole context, as the target does)."""
    tctx, dctx, hctx = (*contexts, None)[:3]
    draft_n_ctx = cfg.target.n_ctx if head or cfg.draft is None else cfg.draft.n_ctx
    slots = []
    for i in range(cfg.parallel):
        t = SeqRange(tctx, i * n_seq, n_seq, cfg.target.n_ctx)
        d = SeqRange(dctx, i * n_seq, n_seq, draft_n_ctx) if dctx is not None else None
        h = SeqRange(hctx, i * n_seq, n_seq, cfg.target.n_ctx) if hctx is not None else None
        slots.append(Slot(i, t, d, h))
    return slots


def log_loaded(eng: LoadedModels, m: Models, n_seq: int) -> None:
    """What was loaded, what it promises, and whether each drafter pays on this box."""
    cfg = eng.cfg
    log.info("engine_loaded", target=str(cfg.target.path), draft=str(cfg.draft.path) if cfg.draft else None,
             head=str(cfg.head.path) if m.second is not None and cfg.head else None, slots=cfg.parallel,
             seqs_per_slot=n_seq, backend=eng.backend_name,
             **({"pairing": m.pairing.describe()} if m.pairing is not None else {}))
    log.info("exactness", promise=eng.exactness(),
             **({"sliding_window": m.target.n_swa} if m.target.n_swa else {}))
    for drafter, v in eng.draft_verdicts.items():
        log.info("draft_economics", drafter=drafter, **v, **({} if v["pays"] else {
            "hint": "no chain of this drafter pays on this box even at the acceptance shown: auto requests "
                    "draft from prompt n-grams and the suffix cache only (`edgespec plan --measure` shows "
                    "the table); a cheaper draft or a faster box changes that"}))
    if m.draft is None:
        log.info("model_free_drafting", hint="no draft model: requests draft from prompt n-grams and the suffix "
                 "cache; to draft with a model set [draft] path to a small model of the target's family (its "
                 "tokenizer; a padded vocabulary is fine; one with another tokenizer drafts through text); "
                 "`edgespec plan --draft FILE` checks the pair")


def fill_sizes(table: dict[int, float]) -> list[int]:
    """The sizes of JAGGED_FILL below `table`'s largest that it lacks, where some size of it
    costs more than JAGGED times a larger one's; none where it rises."""
    low, jagged = float("inf"), False
    for n in sorted(table, reverse=True):
        jagged = jagged or table[n] > JAGGED * low
        low = min(low, table[n])
    top = max(table, default=0)
    return [n for n in JAGGED_FILL if n < top and n not in table] if jagged else []


def calibrate(eng: LoadedModels, slots: Sequence[Slot], cost: CostModel,
              sizes: Sequence[int] = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64), repeats: int = 3,
              budget_seconds: float = 0.25) -> None:
    """Time target and draft forwards per batch size on slot 0 of `slots`, so the controller's
    cost model `cost` describes this machine; `eng.draft_verdicts` says whether each drafter
    pays on it. The sizes are those up to CALIBRATE_AT_LEAST, then those whose
    first timing, in increasing order, fits in `budget_seconds` per model, and where that table
    is jagged, the sizes `fill_sizes` names; then `repeats - 1`
    more rounds over all of them, and each size keeps its fastest. Rounds, not repeats in a
    row: a slow moment (another tenant, the page cache still filling after load) then
    inflates one timing of every size instead of every timing of the first sizes. A batched
    tick's forwards hold several sessions' tokens, so the sizes reach past one tree's. With
    an EAGLE-3 head the draft's curve is the head's forwards (its g inputs zeros: the same
    work), which is how the controller prices the head like any drafter; a head beside the
    draft model gets a curve of its own ("head"). Each curve is fitted on the sizes it was
    timed at."""
    slot = slots[0]
    head = slot.drafter_range("eagle3") if eng.features else None

    def forward(ctx: SeqRange, n: int, start: int, out: list[bool]) -> None:
        toks, pos = [eng.target.bos] * n, list(range(start, start + n))
        if head is not None and ctx is head:  # the head's shared context, in global seq ids
            decode_batch(ctx.ctx, toks, pos, [ctx.to_global((0,))] * n, out,
                         np.zeros((n, ctx.ctx.n_embd), np.float32))
        else:
            ctx.decode_rows(toks, pos, [(0,)] * n, out)

    def measure(ctx: SeqRange, n: int, all_logits: bool = False) -> float:
        # as the steps use them: verification needs every token's logits, a draft catch-up the
        # last token's only (the output head's rows are a real share of a small draft's forward)
        out = [True] * n if ctx is slot.target or all_logits else [False] * (n - 1) + [True]
        t0 = time.perf_counter()
        forward(ctx, n, 32, out)
        dt = time.perf_counter() - t0
        ctx.seq_rm(0, 32, -1)
        return dt

    ranges = {k: r for k, r in (("target", slot.target), ("draft", slot.draft), ("head", slot.head)) if r is not None}
    kinds = tuple(ranges)  # target, then draft and head where loaded
    table: dict[str, dict[int, float]] = {}
    for kind in kinds:
        ctx = ranges[kind]
        ctx.clear()
        forward(ctx, 32, 0, [False] * 32)  # a short prefix
        for _ in range(2):
            measure(ctx, 4)  # warm-up: the first decodes allocate buffers and fault pages in
        spent, table[kind] = 0.0, {}
        for n in (s for s in sizes if s <= eng.cfg.target.n_batch):
            if spent > budget_seconds and max(table[kind], default=0) >= CALIBRATE_AT_LEAST:
                break  # the cost model extrapolates linearly beyond the last size
            table[kind][n] = measure(ctx, n)
            spent += table[kind][n]
        for n in fill_sizes(table[kind]):
            table[kind][n] = measure(ctx, n)
        table[kind] = dict(sorted(table[kind].items()))
        for _ in range(repeats - 1):
            for n in table[kind]:
                table[kind][n] = min(table[kind][n], measure(ctx, n))
    rows: dict[str, float] = {}
    for kind in kinds[1:]:
        n = max((k for k in table[kind] if k <= 4), default=1)
        if n > 1:  # what each extra output row (a tree expansion's) adds to the catch-up timed above
            every = min(measure(ranges[kind], n, all_logits=True) for _ in range(repeats))
            rows[kind] = (every - table[kind][n]) / (n - 1)
    for kind in kinds:  # each on the sizes it was timed at (a slow draft model reaches fewer)
        cost.calibrate(lambda k, n: table[k][n], sizes=tuple(sorted(table[kind])), kinds=(kind,),
                            draft_row=rows or None, context=32)
    # will each drafter pay on this box (plan --measure's arithmetic on these timings)?
    eng.draft_verdicts = {k: v for k in kinds[1:] if 1 in table[k] and
                          (v := drafter_verdict(table["target"], table[k][1], (JUDGED_AT,))) is not None}
    for s in slots:
        s.reset()
