"""The slots of the shared contexts and what they keep for later requests.

Each slot owns a range of sequence ids of the one target context (and of the draft's and a
head's; edgespec/kv.py). A `SlotPool` places a request on the free slot whose caches it can reuse
most, keeps a finished request's prompt prefill (and the draft's and head's caches) for the next
ones, lends them to other slots by a copy inside the unified cache, spills them to the prompt
store (edgespec/prompt_store.py) before they are dropped, and brings a free slot's draft up to
date in idle time. Which drafter a request drafts with is the engine's choice (Engine.choose_drafter);
the pool only says where each would sit and what it would keep there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from edgespec.config import EngineConfig
from edgespec.drafters import ModelDrafter
from edgespec.drafters.eagle3 import HeadCache
from edgespec.drafters.eagle3 import reusable as head_reusable
from edgespec.drafters.model import DraftCache
from edgespec.errors import ForwardAborted, ModelError, Overloaded
from edgespec.kv import SeqRange
from edgespec.logs import get_logger
from edgespec.prompt_store import PromptStore, StoredPrompt
from edgespec.types import GenerationRequest

if TYPE_CHECKING:
    from edgespec import backend
    from edgespec.drafters.base import Drafter

log = get_logger("edgespec.engine")

# llama.cpp's limit on sequence ids in one context (LLAMA_MAX_SEQ)
MAX_SEQ = 256


def seqs_per_slot(parallel: int, max_tree_leaves: int) -> int:
    """Sequence ids each slot's range gets: its main sequence plus one per extra tree leaf (the
    spine's leaf shares the main sequence), within llama.cpp's limit for all slots together less
    the context's scratch sequence (a padded forward's inert tokens: backend.Context)."""
    return max(2, min(max_tree_leaves + 1, (MAX_SEQ - 1) // parallel))


@dataclass
class Slot:
    index: int
    target: SeqRange  # this slot's sequence range of the shared target context
    draft: SeqRange | None
    # with a head beside the draft model (EngineConfig.head): this slot's range of the head's
    # context and what the last request that drafted with the head left there
    head: SeqRange | None = None
    head_cache: HeadCache | None = None
    busy: bool = False
    drafting: str | None = None  # the drafter kind of the request on this slot
    # the prompt tokens (all but the last) whose KV a finished request's prefill left in the
    # target's sequence 0; () when the cache holds nothing reusable
    prefill: tuple[int, ...] = ()
    # what the last request left in the draft's sequence 0 (any shared prefix is reusable there:
    # the draft needs no bit-exactness), or a head's positions and unabsorbed features; None when nothing
    draft_cache: DraftCache | HeadCache | None = None
    # the whole context (prompt and reply) of the last request that ended cleanly: what idle time
    # may bring the draft cache up to (SlotPool.idle_work)
    last_context: tuple[int, ...] = ()
    # what the head-drafting request on this slot lends other slots of its prompt once its prefill
    # is done: the head's positions (which only grow while it runs) and the prompt's features
    lent: HeadCache | None = None
    caller: str = ""  # the caller whose requests left what the slot holds (SlotPool.shares)
    opened: int = 0  # when a request last took the slot (Engine's count of sessions opened)

    @property
    def empty(self) -> bool:
        """Whether the slot holds nothing a later request could reuse."""
        return not (self.prefill or self.last_context or self.draft_cache or self.head_cache or self.lent)

    def reset(self) -> None:
        """Empty every cache; nothing is reusable."""
        self.target.clear()
        for rng in (self.draft, self.head):
            if rng is not None:
                rng.clear()
        self.prefill = ()
        self.draft_cache = self.head_cache = self.lent = None
        self.last_context = ()

    def _beside(self, kind: str | None) -> bool:
        """Whether drafter `kind` is the head beside the draft model (its own range and cache)."""
        return kind == "eagle3" and self.head is not None

    def drafter_range(self, kind: str | None) -> SeqRange | None:
        """The range drafter `kind` ("model", "eagle3") drafts in: the head's when a head sits
        beside the draft model, else the slot's one draft range."""
        return self.head if self._beside(kind) else self.draft

    def cache_of(self, kind: str | None) -> DraftCache | HeadCache | None:
        return self.head_cache if self._beside(kind) else self.draft_cache

    def head_of(self, kind: str | None) -> HeadCache | None:
        """cache_of for a head's kind ("eagle3"), whose cache is its positions and features."""
        return cast("HeadCache | None", self.cache_of(kind))

    def head_to_lend(self, kind: str | None) -> HeadCache | None:
        """What this slot can lend a request drafting with head `kind` on another slot: the
        running request's prompt if it drafts with the head, else what the head's cells hold."""
        return self.lent if self.drafting == kind else self.head_of(kind)

    def set_cache(self, kind: str | None, cache: DraftCache | HeadCache | None) -> None:
        if self._beside(kind):
            self.head_cache = cast("HeadCache | None", cache)
        else:
            self.draft_cache = cache


def reusable_prefix(prefill: Sequence[int], prompt: Sequence[int], chunk: int) -> int:
    """Leading positions of `prompt` whose KV a slot may keep from its last prefill: their common
    prefix (the prompt's last token is never prefilled), cut to whole `chunk`s. With
    batch-invariant forwards (a CPU with the patched ggml: `Engine.reuse_chunk` is 1) a cell holds
    the same bits however the prompt was split, so the whole common prefix is kept. Elsewhere a
    prefill's batches start at position 0 and every `chunk` (n_batch) tokens, and a batch of that
    size is computed the same whatever follows it, so a kept chunk holds exactly the KV this
    prompt's own prefill would write; a partial last chunk (a small batch, another kernel) is
    recomputed."""
    n = min(len(prefill), len(prompt) - 1)
    if n < max(chunk, 1):
        return 0
    a = np.asarray(prefill[:n])
    b = np.asarray(prompt[:n])
    diff = np.flatnonzero(a != b)
    common = int(diff[0]) if len(diff) else n
    return common // chunk * chunk



class PoolHost(Protocol):
    """What the pool reads of the engine that holds it."""

    cfg: EngineConfig
    drafter_kinds: tuple[str, ...]
    draft_kind: str | None
    tick_totals: dict[str, float]

    @property
    def prompt_cache(self) -> bool: ...

    @property
    def reuse_chunk(self) -> int: ...

    @property
    def target_ctx(self) -> backend.Context: ...


class SlotOwner(Protocol):
    """What the pool reads of a request that gives its slot back (edgespec/session.py: Session):
    whether its caches are as the invariants say, and what its drafter and main sequence hold."""

    @property
    def slot(self) -> Slot: ...
    @property
    def drafter(self) -> Drafter | None: ...
    @property
    def drafter_kind(self) -> str | None: ...
    @property
    def tokens(self) -> list[int]: ...
    @property
    def prefill_tokens(self) -> tuple[int, ...]: ...
    @property
    def consistent(self) -> bool: ...
    @property
    def prefilling(self) -> bool: ...


class SlotPool:
    """The slots and the prompt store: where a request sits and what it keeps of earlier ones.
    Confined to the engine thread, as the engine is."""

    def __init__(self, host: PoolHost, slots: list[Slot], prompt_store: PromptStore | None):
        self.host = host
        self.slots = slots
        self.prompt_store = prompt_store  # kept prefills beyond the slots' own, in host memory
        self.opened = 0  # sessions opened: each slot's `opened` says when it was last taken

    @property
    def free(self) -> int:
        return sum(not s.busy for s in self.slots)

    # -- placement ------------------------------------------------------------------------------
    def places(self, req: GenerationRequest) -> dict[str | None, Slot]:
        """The free slot each drafter would draft `req` in (None: no drafter): the one whose
        caches this prompt can reuse most. Overloaded when every slot is busy."""
        free = [s for s in self.slots if not s.busy]
        if not free:
            raise Overloaded(f"all {len(self.slots)} slots are busy")
        kinds: tuple[str | None, ...] = self.host.drafter_kinds or (None,)
        return {k: self.best_slot(req, k, free) for k in kinds}

    def best_slot(self, req: GenerationRequest, kind: str | None, free: list[Slot]) -> Slot:
        """The free slot whose caches `req` drafting with `kind` can reuse most."""
        if not self.host.prompt_cache or len(free) == 1:
            return free[0]

        def reuse(s: Slot) -> tuple[int, int, bool, int]:
            mine = self.shares(s, req)
            cache = s.cache_of(kind) if kind and mine else None
            # on a tie, a slot that holds nothing of another caller's (theirs stays for them),
            # then the least recently used
            return (self.keepable(s, req, kind), cache.reusable(req.prompt_tokens) if cache else 0,
                    mine or s.empty, -s.opened)
        return max(free, key=reuse)

    def take(self, slot: Slot, req: GenerationRequest, kind: str | None) -> int:
        """Mark `slot` busy for `req` drafting with `kind` and bring it what `req` keeps of its
        prompt's prefill (its own cells, another slot's by a copy, or a prompt store entry's);
        returns how many leading prompt positions the target holds."""
        keep, donor, hdonor = self.kept_prefill(slot, req, kind)
        if donor is not None or hdonor is not None or keep < len(slot.prefill):
            self.store(slot)  # what the slot keeps and this request drops, for later ones
        if not self.shares(slot, req):
            slot.reset()  # nothing another caller left serves this request (its own partition keeps it)
        slot.busy = True
        try:
            if hdonor is not None:  # the head's positions and features of the prompt, from elsewhere
                assert kind is not None
                rng, cache = slot.drafter_range(kind), hdonor.head_to_lend(kind)
                assert rng is not None and cache is not None
                rng.clear()
                if not isinstance(hdonor, StoredPrompt):
                    donor_rng = hdonor.drafter_range(kind)
                    assert donor_rng is not None
                    rng.ctx.seq_cp(donor_rng.base, rng.base, 0, cache.n_past)
                elif not self.write_back(rng, hdonor.head_cells, cache.n_past):
                    cache, keep, donor = None, 0, None  # the head has nothing: nor does the target
                slot.set_cache(kind, cache)
            tgt = slot.target
            if donor is not None:
                tgt.clear()
                if isinstance(donor, StoredPrompt):
                    assert self.prompt_store is not None
                    if self.write_back(tgt, donor.target, keep):
                        self.prompt_store.used(donor, keep)
                        self.store_figures()
                    else:
                        keep = 0
                else:
                    self.host.target_ctx.seq_cp(donor.target.base, tgt.base, 0, keep)
            elif keep:
                tgt.seq_rm(0, keep, -1)  # what a finished request left beyond the kept chunks
                for s in range(1, tgt.n_seq_max):
                    tgt.seq_rm(s, -1, -1)
            else:
                tgt.clear()
            slot.prefill = ()  # nothing reusable from this slot until this prefill has completed
            slot.caller = req.caller
            self.opened += 1
            slot.opened = self.opened
            slot.lent = None
            slot.drafting = kind
            return keep
        except BaseException:
            slot.busy = False
            raise

    def kept_prefill(self, slot: Slot, req: GenerationRequest, kind: str | None
                      ) -> tuple[int, Slot | StoredPrompt | None, Slot | StoredPrompt | None]:
        """What a request drafting with `kind` on `slot` keeps of its prompt's prefill: the
        leading positions whose target KV it keeps, the other slot (or prompt store entry) whose
        target cells it copies (None: the slot's own) and, for a head's request, the other slot or
        entry whose head positions and features it copies (None: the slot's own). Any slot's kept
        (or completed) prefill may share its cells by a copy in the unified cache: nothing is
        recomputed. A head's request
        keeps no more of the target's prefill than the head positions (and features) it holds:
        the head needs the target's features of every position it has not absorbed. Those come
        from its own slot or from any other (Slot.head_to_lend): a slot the head is not drafting in
        keeps what its cache says, and a request drafting with the head lends its prompt's once
        its prefill is done (the template or document that concurrent requests share)."""
        if not self.host.prompt_cache:
            return 0, None, None
        prompt, chunk = req.prompt_tokens, self.host.reuse_chunk
        # the slots, then the prompt store's entries, of this caller's partition (`shares`; `slot`
        # itself holding nothing for another's): on a tie the slot's own cells, then another
        # slot's (a copy inside the cache), then an entry's (written back)
        places = [*(s for s in self.slots if s is slot or self.shares(s, req)),
                  *(self.prompt_store.candidates(req.caller) if self.prompt_store else ())]
        foreign = set() if self.shares(slot, req) else {id(slot)}  # `slot` then counts for nothing
        order = {id(p): (p is slot, isinstance(p, Slot)) for p in places}
        held = {id(p): 0 if id(p) in foreign else reusable_prefix(p.prefill, prompt, chunk) for p in places}
        best = max(places, key=lambda p: (held[id(p)], *order[id(p)]))
        keep = held[id(best)]
        if kind != "eagle3" or req.speculation.mode == "plain" or not keep:
            return keep, (best if held[id(best)] > held[id(slot)] else None), None
        head = {id(p): 0 if id(p) in foreign else
                head_reusable(slot.head_of(kind) if p is slot else p.head_to_lend(kind), prompt) for p in places}
        hbest = max(places, key=lambda p: (head[id(p)], *order[id(p)]))
        keep = min(keep, head[id(hbest)]) // chunk * chunk
        if not keep:
            return 0, None, None
        donor = None if held[id(slot)] >= keep else best
        hdonor = None if head[id(slot)] >= keep else hbest
        return keep, donor, hdonor

    def shares(self, slot: Slot, req: GenerationRequest) -> bool:
        """Whether what `slot` holds (its kept prefill, its draft's and head's caches, what idle
        work added to them, what a running request lends) may serve `req` and count in its reuse
        figures: with `prompt_cache_scope = "pooled"` always; else only when `req` comes from the
        caller whose requests left it. A caller reading another's prompt off `cached_tokens` or
        its time to first token is the attack this closes (docs/appliance.md, threat model)."""
        return self.host.cfg.prompt_cache_scope == "pooled" or slot.caller == req.caller

    def store(self, slot: Slot) -> None:
        """Copy what `slot` keeps into the prompt store before a request drops it: the target's
        cells of its kept prefill and, where a head drafted there, the head's positions and the
        features it had not absorbed (edgespec/prompt_store.py)."""
        if self.prompt_store is None or not slot.prefill or slot.busy:
            return
        head = slot.cache_of("eagle3") if "eagle3" in self.host.drafter_kinds else None
        if not (isinstance(head, HeadCache) and head.n_features):
            head = None
        part = self.prompt_store.partition_of(slot.caller)
        if self.prompt_store.holds(part, slot.prefill, head):
            return  # the slot's cells came from an entry that is still there, or as much again
        rng = slot.drafter_range("eagle3")
        cells = rng.seq_state(0) if head is not None and rng is not None else b""
        self.prompt_store.put(StoredPrompt(part, slot.prefill, slot.target.seq_state(0), head, cells))
        self.store_figures()

    def write_back(self, rng: SeqRange, cells: bytes, n: int) -> bool:
        """Write an entry's cells into `rng`'s empty sequence 0 and keep its first `n` positions;
        False (the sequence left empty) when the cache has no room for them."""
        try:
            rng.load_seq_state(cells)
        except ModelError:
            log.warning("prompt_store_write_back_failed", cells_bytes=len(cells))
            rng.seq_rm(0, -1, -1)
            return False
        rng.seq_rm(0, n, -1)
        return True

    def store_figures(self) -> None:
        """The prompt store's figures in tick_totals (Admin.Stats, /metrics)."""
        store = self.prompt_store
        if store is None:
            return
        for k, v in store.figures().items():
            self.host.tick_totals[f"prompt_store_{k}"] = v

    def keepable(self, slot: Slot, req: GenerationRequest, kind: str | None = None) -> int:
        """Prompt positions whose target KV `slot` may keep for `req`: its kept prefill's
        reusable prefix, and for a request that may draft with a head (`kind`), no more than the
        head positions the slot keeps (their target features are not computed again), cut to
        whole reuse chunks."""
        if not self.shares(slot, req):
            return 0
        chunk = self.host.reuse_chunk
        prompt = req.prompt_tokens
        keep = reusable_prefix(slot.prefill, prompt, chunk)
        if kind == "eagle3" and keep and req.speculation.mode != "plain":
            keep = min(keep, head_reusable(slot.head_of(kind), prompt)) // chunk * chunk
        return keep

    # -- idle time ------------------------------------------------------------------------------
    def idle_work(self, budget: int = 16) -> bool:
        """Use idle time: let a free slot's draft absorb up to `budget` more tokens of the last
        context that slot served (its prompt and reply), so that a request sharing a prefix with it
        (a system prompt, a document asked about again, a chat's next turn) finds the draft already
        there and speculates from its second step, instead of paying the draft's prefill (a draft
        forward per prompt piece), which auto often declines to pay for a long prompt. The draft needs
        no bit-exactness, so this is only a matter of time. Call it only when no request waits: one
        call is one draft forward of at most `budget` tokens. Returns whether it did any (call it
        again until it returns False)."""
        if not self.host.prompt_cache or self.host.draft_kind != "model":
            return False
        for slot in self.slots:
            ctx = slot.last_context
            held = slot.draft_cache.tokens if slot.draft_cache is not None else ()
            if slot.busy or slot.draft is None or len(ctx) < 2 or len(held) >= len(ctx):
                continue
            window = self.host.cfg.draft_window
            d = ModelDrafter(slot.draft, window=window)
            tokens = list(ctx)
            d.begin(tokens, cast("DraftCache | None", slot.draft_cache))  # a draft model's (draft_kind)
            if len(tokens) - d.n_past > window:
                # as a request would: the draft holds the context's last `window` tokens, not all
                # of a long one (its every forward would pay attention over them)
                d.start_at(len(tokens) - window)
            try:
                d.absorb(tokens, budget)
            except ForwardAborted:  # a job arrived (abort_idle_work): llama.cpp dropped the piece's
                slot.draft.seq_rm(0, d.n_past - d.offset, -1)  # cells; the draft keeps what it held
                slot.draft_cache = DraftCache(d.offset, tuple(tokens[:d.n_past])) if d.n_past > d.offset else None
                return False
            slot.draft_cache = DraftCache(d.offset, tuple(tokens[:d.n_past]))
            return True
        return False

    # -- a session ends -------------------------------------------------------------------------
    def give_back(self, sess: SlotOwner) -> None:
        """`sess`'s slot keeps what is reusable (the prompt prefill's chunks, the draft's context),
        or is emptied, and is free again (Engine.release)."""
        slot = sess.slot
        if not slot.busy:
            return
        keep = self.host.prompt_cache and sess.consistent and not sess.prefilling
        if sess.drafter is not None:
            # the draft keeps all it holds, the reply included: a chat's next turn starts with it
            slot.set_cache(sess.drafter_kind, sess.drafter.keep(sess.tokens) if keep else None)
            if slot.cache_of(sess.drafter_kind) is None:
                sess.drafter.end()
        slot.last_context = tuple(sess.tokens) if keep else ()
        if keep:
            # keep the prompt prefill's cells for the next request (seq 0 holds the context, the
            # other sequences are empty after every step); drop what decoding wrote after them
            slot.target.seq_rm(0, len(sess.prefill_tokens), -1)
            slot.prefill = sess.prefill_tokens
        else:
            slot.target.clear()
            slot.prefill = ()
        slot.busy = False
        slot.drafting = None
        slot.lent = None
