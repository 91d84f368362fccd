"""What a session is built of: the per-request parts a request drafts and decides with.

    draft_range(host, req, slot, kind)   the range it drafts in, or None (no drafter pays)
    new_drafter(host, slot, kind)        its drafter in that range (drafters/base.py: Drafter)
    new_lookups(host, req)               its prompt lookups, from its caller's learnt reach
    new_suffix_drafter(host, req)        its view of the cross-request suffix cache
    new_controller(host, req, slot, ..)  its speculation controller (auto requests)

A session (edgespec/session.py) builds its parts with these as it opens; the engine
(edgespec/engine.py) is the `PartsHost` they read: the loaded drafters and what calibration found
of them, the shared cost model and acceptance priors, the suffix cache and the lookups' priors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from edgespec.controller import AcceptancePrior, Controller, ControllerConfig, CostModel
from edgespec.drafters import NgramDrafter, drafter_class
from edgespec.drafters.suffix import SuffixDrafter

if TYPE_CHECKING:
    from edgespec import backend
    from edgespec.config import EngineConfig
    from edgespec.drafters.base import Drafter
    from edgespec.drafters.ngram import ReachPriors
    from edgespec.drafters.suffix import SuffixCache
    from edgespec.kv import SeqRange
    from edgespec.slots import Slot
    from edgespec.types import GenerationRequest


class PartsHost(Protocol):
    """What a request's parts are built from (edgespec/engine.py: Engine)."""

    @property
    def cfg(self) -> EngineConfig: ...
    @property
    def target(self) -> backend.Model: ...
    @property
    def draft(self) -> backend.Model | None: ...
    @property
    def draft_kind(self) -> str | None: ...
    @property
    def controller_cfg(self) -> ControllerConfig: ...
    @property
    def cost(self) -> CostModel: ...
    @property
    def priors(self) -> dict[str, AcceptancePrior]: ...
    @property
    def prior(self) -> AcceptancePrior: ...
    @property
    def suffix_enabled(self) -> bool: ...
    @property
    def suffix_cache(self) -> SuffixCache: ...
    @property
    def lookup_priors(self) -> ReachPriors: ...

    def cost_kind(self, kind: str | None) -> str: ...
    def drafter_pays(self, kind: str) -> bool: ...


def draft_range(host: PartsHost, req: GenerationRequest, slot: Slot, kind: str | None) -> SeqRange | None:
    """The range `req` drafts in with drafter `kind` on `slot`, or None: no drafter, or one that
    calibration found pays on this box at no chain (drafter_pays) for an auto request, which
    then drafts model-free and whose controller knows it has no draft. The one place that
    reads the verdict."""
    if req.speculation.mode == "auto" and kind and not host.drafter_pays(kind):
        return None
    return slot.drafter_range(kind)


def new_drafter(host: PartsHost, slot: Slot, kind: str | None = None) -> Drafter:
    """The drafter of one request on `slot` (drafters/base.py: Drafter): `kind` ("model",
    "eagle3"; default the draft's)."""
    kind = kind or host.draft_kind
    assert kind is not None  # a session without a draft range builds no drafter
    models = {"target": host.target, "draft": host.draft} if kind == "text" else {}
    drafter: Drafter = drafter_class(kind)(slot.drafter_range(kind), window=host.cfg.draft_window, **models)
    return drafter


def new_lookups(host: PartsHost, req: GenerationRequest) -> NgramDrafter | None:
    """A request's prompt lookups (drafters/ngram.py), their reach starting from what recent
    requests' achieved in its caller's partition (the suffix cache's); None when it asks for none."""
    if not req.speculation.ngram:
        return None
    return NgramDrafter(prior=host.lookup_priors.reach(host.suffix_cache.partition_of(req.caller)))


def new_suffix_drafter(host: PartsHost, req: GenerationRequest) -> SuffixDrafter | None:
    """A request's view of the suffix cache: None when the cache is off, or the request does
    not speculate (plain mode) or opts out; such a request does not feed the cache either."""
    if not host.suffix_enabled or req.speculation.mode == "plain" or not req.speculation.suffix:
        return None
    return SuffixDrafter(host.suffix_cache, req.caller)


def new_controller(host: PartsHost, req: GenerationRequest, slot: Slot, kind: str | None,
                   has_draft: bool) -> Controller:
    """The speculation controller of one auto request on `slot` (edgespec/controller/), pricing
    and judging drafter `kind` (its cost curve and acceptance prior); `has_draft`: whether it
    drafts with it (draft_range)."""
    spec = req.speculation
    kind = kind or host.draft_kind
    return Controller(host.controller_cfg, host.cost.drafting(host.cost_kind(kind)),
                      host.priors.get(kind, host.prior) if kind else host.prior, max_depth=spec.tree_depth,
                      max_nodes=spec.tree_nodes, has_draft_model=has_draft,
                      max_leaves=slot.target.n_seq_max, request_id=req.request_id, refine_costs=False)
