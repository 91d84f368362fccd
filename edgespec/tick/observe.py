"""Observe: one record of the tick feeds the shared cost model (the forwards as they ran, batch
sizes of the whole tick), each session's stats and controller, and the engine's phase timings.

A controller judges speculation against plain decoding for its own request, so it is told what
its step would have cost alone: the cost model's prediction for its own shape, scaled by how the
tick's measured forwards compared with the model's prediction for them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from edgespec.tick.contract import TickRecord

if TYPE_CHECKING:
    from edgespec.tick.contract import TickEngine
    from edgespec.tick.draft import DraftRecord
    from edgespec.tick.forward import ForwardRecord
    from edgespec.tick.schedule import Plan

PHASES = ("schedule", "draft", "forward", "verify_commit_emit", "observe")


def observe(engine: TickEngine, plan: Plan, drafts: DraftRecord, fwd: ForwardRecord, *,
            phases: tuple[float, ...], t_start: float) -> None:
    t0 = time.perf_counter()
    cost = engine.cost
    verify_seconds = fwd.seconds
    if fwd.tokens and (fwd.prefill_tokens or fwd.first_tokens):
        # prefill pieces rode in the verification's forward: its time is not that of a forward of
        # fwd.tokens tokens (filed as one, it inflated the small sizes' levels several-fold at 8
        # streams). The curves and the thread governor learn from pure verifications only; the
        # sessions are told the verification's share, as the model prices the two parts.
        at = cost.at(plan.context, plan.sequences)
        read = fwd.prefill_tokens + fwd.first_tokens
        verify_seconds *= at.verify_seconds(fwd.tokens) / at.verify_seconds(fwd.tokens + read)
    elif fwd.tokens:
        cost.observe("target", fwd.tokens, fwd.seconds, plan.context, plan.sequences)
        engine.threads.record(engine.threads_now, fwd.seconds, cost.calibrated_seconds("target", fwd.tokens))
    for r in drafts.rounds:
        cost.observe(r.kind, r.tokens, max(r.seconds - max(0, r.rows - 1) * cost.row_seconds(r.kind), 0.5 * r.seconds))
    pred_v = sum(p.predicted[0] for p in plan.steps.values())
    pred_d = sum(p.predicted[1] for s, p in plan.steps.items() if s in drafts.sessions)
    alone = len(plan.decoding) == 1
    scale = (verify_seconds + drafts.seconds) / (pred_v + pred_d) if pred_v + pred_d > 0 else 1.0
    now = time.perf_counter()
    if (plan.guard_key is not None and not plan.prefill and not plan.absorbing
            and plan.catchup <= engine.goodput.max_catchup):
        # realised goodput of the tick, for the guard: speculating (a drafter ran, or prompt
        # lookups or the suffix cache grafted) or plain. Not a tick whose drafter first read a
        # long backlog (a request's prompt, or the tokens decoded while the guard held the level
        # plain): that debt is paid once, and scoring it sank the very probes that could end a
        # fallback, each lost probe doubling the next wait
        records = [s.record for s in plan.steps if s.record is not None]
        guessed = bool(drafts.sessions) or any(r.guessed for r in records)
        engine.goodput.record(plan.guard_key, guessed, sum(r.emitted for r in records), now - t_start,
                              plan.guard_unit)
    for s, step in plan.steps.items():
        v, d = step.predicted
        drafted = s in drafts.sessions
        waited = drafts.seconds_of(engine.cost_kind(s.drafter_kind)) if drafted else 0.0  # its drafter's forwards
        s.observe(target_seconds=fwd.seconds, draft_seconds=waited,
                  verify_share=verify_seconds if alone else v * scale,
                  draft_share=(waited if alone else d * scale) if drafted else 0.0,
                  step_seconds=now - t_start)
    secs = dict(zip(PHASES, phases + (time.perf_counter() - t0,)))
    rec = TickRecord(len(plan.decoding) + len(plan.prefill), len(plan.decoding), fwd.tokens,
                     len(drafts.rounds), fwd.prefill_tokens, secs)
    engine.last_tick = rec
    totals = engine.tick_totals
    totals["ticks"] = totals.get("ticks", 0) + 1
    for k, v in secs.items():
        totals[k + "_seconds"] = totals.get(k + "_seconds", 0.0) + v
    totals["forward_target_seconds"] = totals.get("forward_target_seconds", 0.0) + fwd.seconds
    totals["forward_prefill_seconds"] = totals.get("forward_prefill_seconds", 0.0) + fwd.prefill_seconds
    totals["draft_forward_seconds"] = totals.get("draft_forward_seconds", 0.0) + drafts.seconds
    totals["verify_tokens"] = totals.get("verify_tokens", 0) + fwd.tokens
    totals["session_steps"] = totals.get("session_steps", 0) + len(plan.decoding)
    totals.update(cost.flat())  # the online cost curves beside the start-up calibration
    totals.update(engine.goodput.flat())
    totals.update(engine.lookup_priors.flat())
    totals.update(engine.threads.as_dict())
