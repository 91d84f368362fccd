"""The engine tick: every active session advances by one step, together.

    plan   = schedule(engine, sessions)    who speculates with which shape (jointly, priced on the
                                           whole batch); which prefill pieces and draft catch-ups ride along
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
"""

from __future__ import annotations

import time

from edgespec.tick.draft import draft
from edgespec.tick.forward import verify_forward
from edgespec.tick.observe import observe
from edgespec.tick.schedule import schedule
from edgespec.types import Chunk

EMPTY = Chunk((), "", None)


def tick(engine, sessions: list) -> dict:
    t0 = time.perf_counter()
    plan = schedule(engine, sessions)
    t1 = time.perf_counter()
    drafts = draft(engine, plan)
    t2 = time.perf_counter()
    fwd = verify_forward(engine, plan)
    t3 = time.perf_counter()
    chunks = {s: EMPTY for s in sessions}
    for s in plan.decoding:
        chunks[s] = s.finish_step(fwd.rows[s])
    for s, (rows, feats) in fwd.first.items():
        chunks[s] = s.first_step(rows, feats)
    t4 = time.perf_counter()
    observe(engine, plan, drafts, fwd, phases=(t1 - t0, t2 - t1, t3 - t2, t4 - t3), t_start=t0)
    return chunks
