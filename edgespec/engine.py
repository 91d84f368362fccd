"""The speculative engine: the tick's host.

ONE target context and ONE draft context serve every slot (`kv_unified`): slot i owns a range of
sequence ids (edgespec/kv.py), its main sequence plus its tree's branches (edgespec/slots.py). The
engine's tick (edgespec/tick/) decodes every active session's [root] + tree in one target forward;
a session (edgespec/session.py) is one request on one slot. Plain decoding is the same tick with
empty trees; a request alone is a tick over one session.

The engine admits a request to a slot (SlotPool places it and brings it what it keeps of earlier
prompts), chooses its drafter (with a head beside the draft model, the one the measured costs and
acceptances favour at the load it meets: `choose_drafter`, edgespec/controller/drafter_choice.py),
opens its session (which builds its per-request parts from the engine's state:
edgespec/session_parts.py) and hosts the shared state the tick reads: the cost model, each
drafter's acceptance prior, the goodput guard, the thread governor and the tick's totals. Loading,
calibration and what the models promise are edgespec/loading.py's.

The engine stands above what it hosts: it imports the session, the slots, loading and the tick;
none of them imports it. Each reads the engine through a Protocol of its own: the tick's
`TickEngine` (tick/contract.py), the session's `SessionHost` (session.py) and its parts'
`PartsHost` (session_parts.py), the pool's `PoolHost` (slots.py).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, cast

import numpy as np

from edgespec import backend, loading
from edgespec.config import EngineConfig
from edgespec.controller import AcceptancePrior, ControllerConfig, CostModel
from edgespec.controller.drafter_choice import DrafterChoice
from edgespec.controller.goodput import GoodputGuard
from edgespec.controller.threads import ThreadGovernor
from edgespec.drafters.eagle3 import HeadCache
from edgespec.drafters.model import DraftCache
from edgespec.drafters.ngram import ReachPriors
from edgespec.drafters.suffix import SuffixCache
from edgespec.errors import BadRequest, ForwardAborted, Overloaded
from edgespec.loading import AnyContext, LoadedModels
from edgespec.logs import get_logger
from edgespec.prompt_store import PromptStore
from edgespec.sampling import SamplingParams
from edgespec.session import Session
from edgespec.slots import Slot, SlotPool, seqs_per_slot
from edgespec.tick import tick as run_tick
from edgespec.tick.contract import TickRecord
from edgespec.types import Chunk, GenerationRequest, GenerationResult

log = get_logger("edgespec.engine")



def pad_forwards(cost: CostModel, contexts: tuple[AnyContext | None, ...], cfg: EngineConfig) -> CostModel:
    """`cost`, with the target's and draft model's contexts padding each forward to the width it
    is priced at (backend.Context). Where `[speculation] pad_forwards` asks for it (auto: a target
    on a GPU) that is one of the fixed widths (controller/widths.py): a shape that repeats from
    step to step keeps a GPU's CUDA graph warm. Otherwise a forward is padded only up to a wider
    measured width that costs less (`CostModel.pad_to`): the controller prices n tokens at the
    cheapest forward that holds them, and a CPU's repacked K-quant and Q4_0 kernels take 4
    columns at a time, so there 3 tokens cost more than 4. An EAGLE-3 head is not padded."""
    from edgespec.controller.widths import WIDTHS

    on = cfg.pads_forwards(cfg.target.n_gpu_layers != 0 and backend.gpu_offload_supported())
    log.info("pad_forwards", on=on, setting=cfg.pad_forwards, widths=list(WIDTHS) if on else "cheaper measured")
    if on:
        cost.widths = WIDTHS
    for ctx, kind in zip(contexts, ("target", "draft")):
        if ctx is not None and not isinstance(ctx, backend.HeadContext):
            ctx.pad_width = partial(cost.pad_to, kind=kind)
            cost.padded.add(kind)
    return cost


class Engine(LoadedModels):
    """Loaded models (LoadedModels), their slots (SlotPool), the shared cost model and acceptance
    priors, and the tick over the active sessions. Confined to one thread (the daemon's engine
    thread)."""

    def __init__(self, cfg: EngineConfig, target: backend.Model, draft: backend.Model | None, slots: list[Slot],
                 contexts: tuple[AnyContext | None, ...] = (), draft_kind: str | None = None, head: backend.Model | None = None):
        super().__init__(cfg, target, draft, contexts, draft_kind, head)

        self.controller_cfg = ControllerConfig()
        self.cost = pad_forwards(CostModel(), contexts, cfg)  # a GPU's forwards at fixed widths
        # each drafter's acceptance, learnt across the requests that drafted with it
        self.priors = {k: AcceptancePrior() for k in self.drafter_kinds or ("model",)}
        self.prior = self.priors[self.drafter_kinds[0] if self.drafter_kinds else "model"]
        self.drafter_choice = DrafterChoice()  # which drafter a request drafts with (two loaded)
        self.goodput = GoodputGuard()  # auto falls back to plain where speculating measured slower
        # the target's and draft's CPU threads: the configured count or one (controller/threads.py)
        self.threads = ThreadGovernor(cfg.target.n_threads,
                                      enabled=all(hasattr(c, "set_threads") for c in contexts if c is not None)
                                      and cfg.target.n_gpu_layers == 0)
        self._threads_applied = cfg.target.n_threads
        self.last_tick: TickRecord | None = None  # the last tick's record (edgespec/tick/observe.py)
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
    def load(cls, cfg: EngineConfig, controller_cfg: Any = None, calibrate: bool = True) -> Engine:
        """Load the target (and a draft model or EAGLE-3 head, and a head beside a draft model),
        make the shared contexts and their slots (edgespec/loading.py), and calibrate the cost
        model on this machine. `controller_cfg`: a ControllerConfig (a class settings.py makes at
        import: Any to mypy)."""
        cfg.validate()
        m = loading.read_models(cfg)
        n_seq = seqs_per_slot(cfg.parallel, cfg.max_tree_leaves)
        contexts = loading.make_contexts(cfg, m, n_seq)
        slots = loading.make_slots(cfg, contexts, n_seq, head=m.head is not None)
        eng = cls(cfg, m.target, m.draft, slots, contexts, m.kind, head=m.second)
        eng.pairing = m.pairing
        if controller_cfg is not None:
            eng.controller_cfg = controller_cfg
        if calibrate:
            eng.calibrate()
        loading.log_loaded(eng, m, n_seq)
        return eng

    def choose_drafter(self, req: GenerationRequest, slots: Mapping[str | None, Slot] | None = None) -> str | None:
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
        cache: DraftCache | HeadCache | None
        if hdonor is not None:  # the head's positions and features come from another slot
            cache = hdonor.head_to_lend(kind)
        else:
            cache = slot.cache_of(kind) if self.prompt_cache and self.pool.shares(slot, req) else None
        held = cache.reusable(prompt) if cache is not None else 0
        backlog = max(1, len(prompt) - 1 - held)
        if kind == "model":
            backlog = min(backlog, self.cfg.draft_window)
        return cost.verify_seconds(max(1, prefill)) + cost.draft_seconds(backlog)

    def suffix_control(self, enabled: bool | None = None, clear: bool = False) -> dict[str, Any]:
        """Turn the suffix cache on or off (off empties it) and/or empty it (SetPolicy, SIGHUP);
        returns its stats."""
        if enabled is not None:
            self.suffix_enabled = bool(enabled)
        if clear or not self.suffix_enabled:
            self.suffix_cache.clear()
        if clear:
            self.lookup_priors.clear()
        return self.suffix_stats()

    def suffix_stats(self) -> dict[str, Any]:
        return {"enabled": self.suffix_enabled, **self.suffix_cache.stats()}

    @property
    def threads_now(self) -> int:
        """The thread count the current tick's forwards use (the governor's last choice)."""
        return self._threads_applied

    def calibrate(self, sizes: Sequence[int] = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64), repeats: int = 3,
                  budget_seconds: float = 0.25) -> None:
        """Time forwards per batch size so the cost model describes this machine (loading.calibrate)."""
        loading.calibrate(self, self.slots, self.cost, sizes, repeats, budget_seconds)

    def warmup(self) -> None:
        toks = self.tokenize("Hello")
        self.generate(GenerationRequest(tuple(toks), SamplingParams(max_tokens=2)))

    # -- text ---------------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        """The most tokens one request may hold (the shared context holds every slot's)."""
        return self.slots[0].target.n_ctx

    def model_info(self) -> dict[str, Any]:
        t, d, h = self.target, self.draft, self.head

        def info(m: backend.Model | None) -> dict[str, Any] | None:
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
        out: list[np.ndarray | None] = []
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
        assert out[0] is not None
        return out[0], out[1]

    # -- sessions -----------------------------------------------------------------------------
    def idle_work(self, budget: int = 16) -> bool:
        """Bring a free slot's draft up to its last context in idle time (SlotPool.idle_work)."""
        return self.pool.idle_work(budget)

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
                prior = self.priors.get(sess.drafter_kind, self.prior) if sess.drafter_kind else self.prior
                prior.update_from(sess.controller.evidence())
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
            # the tick hands back the sessions it was given: Session, as TickSession
            return cast("dict[Session, Chunk]", run_tick(self, list(sessions)))
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

