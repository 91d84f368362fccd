"""The engine tick: every active session advances by one step, together.

    plan   = schedule(engine, sessions)    who speculates with which shape (jointly, priced on the
                                           whole batch); which prefill pieces and draft catch-ups ride
                                           along; who sits the tick out (a grammar waiting for its
                                           share of the engine: an empty chunk). It changes nothing:
    start(engine, plan)                    each decoding session's step begins as planned (the
                                           guard and its controller are told what was decided); the
                                           grammars' masks share the tick's mask time
    drafts = draft(engine, plan)           all drafters, level by level: ONE draft forward per level
    fwd    = verify_forward(engine, plan)  ONE target forward: every decoding session's [root] + tree;
                                           then the prefill pieces (a piece that ends its prompt
                                           takes the prompt's last token too: the first token)
    for each decoding session:             pure verification, KV commit inside its sequence range, emit
        chunk = s.finish_step(fwd.rows[s])
    for each prompt read to its end:       its first token, a plain step of its own
        chunk = s.first_step(rows, features)
    observe(engine, plan, drafts, fwd)     one record feeds the cost model, each controller, the stats

A session alone is a tick over one session: single-stream decoding runs the same code.

What the phases may touch of a session and of the engine is tick/contract.py's (`TickSession`,
`TickEngine`); what they hand each other is typed: the schedule's `Plan` of per-session
`StepPlan`s, the drafts' `DraftRecord`, the forward's `ForwardRecord`, the step's `StepRecord`
(tick/step.py) that a session keeps from begin_step to observe.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from edgespec.tick.draft import draft
from edgespec.tick.forward import verify_forward
from edgespec.tick.observe import observe
from edgespec.tick.schedule import schedule, share_masks, start
from edgespec.types import Chunk

if TYPE_CHECKING:
    from edgespec.tick.contract import TickEngine, TickSession

EMPTY = Chunk((), "", None)


def tick(engine: TickEngine, sessions: list[TickSession]) -> dict[TickSession, Chunk]:
    t0 = time.perf_counter()
    plan = schedule(engine, sessions)
    start(engine, plan)
    share_masks(plan.decoding + plan.prefilling)
    t1 = time.perf_counter()
    drafts = draft(engine, plan)
    t2 = time.perf_counter()
    fwd = verify_forward(engine, plan)
    t3 = time.perf_counter()
    chunks: dict[TickSession, Chunk] = {s: EMPTY for s in sessions}
    for s in plan.decoding:
        chunks[s] = s.finish_step(fwd.rows[s])
    for s, (rows, feats) in fwd.first.items():
        chunks[s] = s.first_step(rows, feats)
    t4 = time.perf_counter()
    observe(engine, plan, drafts, fwd, phases=(t1 - t0, t2 - t1, t3 - t2, t4 - t3), t_start=t0)
    return chunks
