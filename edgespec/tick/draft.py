"""Draft: every speculating session's drafter, level by level, each level of ALL sessions in one
draft forward.

Drafters are generators (drafters/base.py: `propose_steps`, `absorb_steps`): each yields the
draft batch its next level needs (local sequence ids of its slot's range) and is sent that
batch's rows (logits; for an EAGLE-3 head also its pre-norm outputs). Round r decodes level r of
every drafter still growing, plus the draft catch-up pieces the schedule asked for, as one
forward on the shared draft context (a draft model's, or a head's: then every entry carries its
g input, `DraftBatch.embd`). With a head beside the draft model, each round is one forward per
context: the sessions drafting with the head in one, those drafting with the model in the other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from edgespec.drafters.base import DraftBatch, decode_batch

if TYPE_CHECKING:
    from edgespec.tick.contract import DraftSteps, TickEngine, TickSession
    from edgespec.tick.schedule import Plan


class DraftRound(NamedTuple):
    """One draft forward of the tick."""

    tokens: int  # entries decoded
    rows: int  # output rows
    seconds: float
    kind: str  # the cost kind of its drafter's forwards: "draft" or "head"


@dataclass
class DraftRecord:
    rounds: list[DraftRound] = field(default_factory=list)  # the tick's draft forwards, in order
    sessions: set[TickSession] = field(default_factory=set)  # sessions whose drafter decoded this tick

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.rounds)

    def seconds_of(self, kind: str) -> float:
        """Seconds of the forwards of one cost kind (the drafter a session waited for)."""
        return sum(r.seconds for r in self.rounds if r.kind == kind)


def draft(engine: TickEngine, plan: Plan) -> DraftRecord:
    rec = DraftRecord()
    gens: dict[TickSession, DraftSteps] = {}
    for s, step in plan.steps.items():
        g = s.absorb_steps(step.absorb) if step.absorb is not None else s.draft_steps()
        if g is None:
            s.drafted(None)
        else:
            gens[s] = g
    pending: dict[TickSession, DraftBatch] = {}
    for s, g in gens.items():
        _advance(s, g, None, pending, absorbing=plan.steps[s].absorb is not None)
    while pending:
        groups: dict[int, list[TickSession]] = {}  # the draft context -> its sessions this round
        for s in pending:
            groups.setdefault(id(s.draft_range.ctx if s.draft_range is not None else None), []).append(s)
        for order in groups.values():
            _round(engine, order, pending, gens, plan, rec)
    return rec


def _round(engine: TickEngine, order: list[TickSession], pending: dict[TickSession, DraftBatch],
           gens: dict[TickSession, DraftSteps], plan: Plan, rec: DraftRecord) -> None:
    """One draft forward on one shared context: the next batch of each of `order`'s drafters."""
    tokens: list[int] = []
    positions: list[int] = []
    seqs: list[list[int]] = []
    logits: list[bool] = []
    counts: list[int] = []
    embd: list[np.ndarray] = []
    for s in order:
        b = pending[s]
        rng = s.draft_range
        assert rng is not None  # a session with a drafter has its range
        tokens += b.tokens
        positions += b.positions
        seqs += [rng.to_global(x) for x in b.seqs]
        logits += b.logits
        counts.append(sum(1 for x in b.logits if x))
        if b.embd is not None:
            embd.append(b.embd)
    t0 = time.perf_counter()
    first = order[0].draft_range
    assert first is not None
    rows = decode_batch(first.ctx, tokens, positions, seqs, logits, np.concatenate(embd) if embd else None)
    rec.rounds.append(DraftRound(len(tokens), len(rows), time.perf_counter() - t0,
                                 engine.cost_kind(order[0].drafter_kind)))
    rec.sessions.update(order)
    at = 0
    for s, k in zip(order, counts):
        part = rows[at:at + k]
        at += k
        _advance(s, gens[s], part, pending, absorbing=plan.steps[s].absorb is not None)


def _advance(s: TickSession, gen: DraftSteps, rows: np.ndarray | None, pending: dict[TickSession, DraftBatch],
             absorbing: bool) -> None:
    """Send a drafter its rows; keep its next batch, or hand its report to the session."""
    try:
        pending[s] = gen.send(rows) if rows is not None else next(gen)
    except StopIteration as stop:
        pending.pop(s, None)
        s.drafted(None if absorbing else stop.value)
        if absorbing:
            s.stats.draft_forwards += 1
