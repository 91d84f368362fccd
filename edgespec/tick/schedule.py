"""Schedule: what each session does this tick.

Speculation that knows the load. Each session's controller proposes what it would speculate
alone (its breaker, probes, first-token and catch-up rules stay per request); with several
sessions decoding, the shapes of the auto sessions are then chosen *jointly*, maximising the
tick's expected emitted tokens per second on the measured cost curves of the whole batch:

    rate = sum_i E_i / (target(sum_i (nodes_i + 1)) + sum_l draft(sum_i batch_i,l) + overheads)

(each sum over draft levels runs once per drafter context: with a head beside the draft model,
a session's draft batches join its own drafter's forwards, priced on that drafter's curve) by
greedy ascent from plain decoding, each move one session one rung up its ladder (plain,
shorter chains, its own choice), while the rate grows. On a flat cost curve (one session, or a
GPU) every session keeps its own choice; as verification tokens get dearer (more sessions on a
CPU) the trees shrink by themselves, down to plain decoding. Sessions reading their prompt count
as streams in that rate (`_joint`). Explicit modes (CHAIN/TREE) keep their shape.

A session's suffix-cache proposal (drafters/suffix.py) costs no forward: when it alone promises
more than the session's draft shape, the step decodes plainly with the proposal grafted (no draft
forward); otherwise it grafts onto the draft tree. Either way its nodes are priced, like prompt
lookups, on the tick's marginal verification cost.

Prefill rides along: a prompt is prefilled in pieces, one per tick, so streams already running
keep getting tokens. Alone, a piece is a whole n_batch chunk; beside decoding sessions it is the
largest piece that adds at most `prefill_share` times the tick's decode work to the tick: the
marginal cost of its tokens on the verification curve, once the drafts (grafts included) have
set the verification's size (`pieces`, called by the forward). A draft catch-up longer than
the piece the schedule foresees is absorbed in pieces too while the session decodes plainly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from edgespec.controller import CostModel, Decision, expansion_batches
from edgespec.shape import PLAIN, Shape, chain
from edgespec.tick.step import Batch

if TYPE_CHECKING:
    from edgespec.tick.contract import TickEngine, TickSession

MIN_PIECE = 16  # a prefill piece is never smaller: every prompt progresses


@dataclass(frozen=True)
class StepPlan:
    """What one decoding session does this tick."""

    shape: Shape  # what it speculates (the joint choice; PLAIN while absorbing or held bare)
    # what the session would speculate alone, and what that changes in its controller (`start`
    # commits it); None when the guard held the step bare and nothing was asked
    decision: Decision | None = None
    bare: bool = False  # the goodput guard turned this auto step plain, grafts and all
    absorb: int | None = None  # draft tokens to absorb instead of drafting (a plain step), or None
    predicted: tuple[float, float] = (0.0, 0.0)  # (verify, draft) seconds the step costs alone


# one prefill piece riding the forward: (session, its tokens, start position)
Piece = tuple["TickSession", list[int], int]


@dataclass
class Plan:
    """The schedule's answer: each decoding session's step plan (in decoding order), the
    sessions reading their prompt, and what the tick's pricing found. Computing it begins nothing
    (`start` does); only `pieces` fills `prefill` in, once the drafts have set the
    verification's size."""

    steps: dict[TickSession, StepPlan] = field(default_factory=dict)
    prefill: list[Piece] = field(default_factory=list)  # set by `pieces`
    prefilling: list[TickSession] = field(default_factory=list)  # reading their prompt, the oldest first
    # sessions sitting this tick out: their grammar's masks wait for their share of the engine
    # (constraint.Matcher.waiting); their slots are kept, and `start` tells their matchers
    held: list[TickSession] = field(default_factory=list)
    draft_seconds: float = 0.0  # the drafters' predicted forwards this tick (decode work beside verification)
    context: int = 0  # positions cached by the tick's sessions together
    sequences: int = 1  # the tick's sessions (each query's attention reads its own sequence's cells)
    batch: Batch = field(default_factory=Batch)
    guard_key: tuple[int, int] | None = None  # the goodput guard's load level of this tick
    guard_asked: bool = False  # an auto session decodes: `start` asks the guard (GoodputGuard.allow)
    guard_new: bool = False  # a request starts decoding alone: `start` tells the guard first
    guard_unit: float = 0.0  # the cost model's seconds per plain token at this many sessions
    catchup: int = 0  # the longest draft catch-up a speculating session carries this tick

    @property
    def decoding(self) -> list[TickSession]:
        """The sessions verifying this tick."""
        return list(self.steps)

    @property
    def absorbing(self) -> bool:
        """Whether a session absorbs a draft catch-up this tick instead of drafting."""
        return any(p.absorb is not None for p in self.steps.values())


@dataclass
class _Rung:
    shape: Shape
    tokens: float  # expected emitted tokens
    nodes: int  # verified tokens - 1
    batches: tuple[int, ...]  # draft batch per level (level 1 = catch-up)
    drafter: str = "draft"  # the cost kind of the drafter's forwards ("draft", "head")


def schedule(engine: TickEngine, sessions: Sequence[TickSession]) -> Plan:
    """Who decodes this tick with which shape, and who reads their prompt. Changes nothing: the
    goodput guard and the sessions' controllers are only asked (GoodputGuard.allows,
    Controller.decide); `start` tells them what was decided. (A suffix view computes its
    proposal once per context length, SuffixDrafter.look: the step's grafts read the same one.)"""
    plan = Plan()
    prefilling = [s for s in sessions if s.prefilling and not s.done]
    decoding, plan.held = _pace(sessions, prefilling)
    active = decoding + prefilling
    plan.sequences = len(active)
    plan.context = sum(s.context for s in active)
    cost = engine.cost.at(plan.context, plan.sequences)
    bare = _guard(engine, plan, decoding, cost) if decoding else set()
    # a session the guard turned plain asks its controller nothing (the search is most of a
    # tick's Python time at 8 streams)
    decisions = {s: s.decide() for s in decoding if s not in bare}
    shapes = {s: _suffix_first(engine, s, decisions[s].shape, cost) if s in decisions else PLAIN for s in decoding}
    if (len(decoding) > 1 or prefilling) and not bare:
        shapes = _joint(engine, decoding, shapes, cost, waiting=len(prefilling))
    decode_seconds = 0.0
    if decoding:
        rungs = [_rung_of(engine, s, shapes[s], cost) for s in decoding]
        decode_seconds = _tick_seconds(rungs, cost)
        plan.batch = Batch(sum(r.nodes + 1 for r in rungs), decode_seconds / sum(r.tokens for r in rungs))
    if decoding:
        plan.draft_seconds = max(0.0, decode_seconds - cost.verify_seconds(plan.batch.tokens))
    piece = _piece(engine, cost, plan.batch.tokens if decoding else None, decode_seconds)
    final: dict[TickSession, Shape] = {}
    absorb: dict[TickSession, int] = {}
    for s in decoding:
        shape = shapes[s]
        backlog = s.drafter.backlog(s.tokens) if s.drafter is not None else 0
        if shape.mode != "plain" and len(decoding) > 1 and backlog > piece and shape.depth > 0:
            # a long draft catch-up would stall every stream of the tick: take it in pieces
            absorb[s] = piece
            shape = PLAIN
        final[s] = shape
        if shape.mode != "plain":
            plan.catchup = max(plan.catchup, backlog)
    plan.prefilling = prefilling
    for s in decoding:
        r = _rung_of(engine, s, final[s], cost)
        predicted = (cost.verify_seconds(r.nodes + 1), _draft_seconds([r.batches], cost.drafting(r.drafter)))
        plan.steps[s] = StepPlan(final[s], decisions.get(s), s in bare, absorb.get(s), predicted)
    return plan


def start(engine: TickEngine, plan: Plan) -> None:
    """Begin the tick as the plan says (`schedule` itself changes nothing): the goodput guard
    hears of a request starting alone and is asked for the tick (it answers what `allows` said);
    each decoding session's controller commits what it decided and hears of a shape the tick
    changed, and its step record opens."""
    if plan.guard_key is not None:
        guard = engine.goodput
        if plan.guard_new:
            guard.new_request(plan.guard_key)
        for s in plan.steps:
            s.guard_seen = True
        if plan.guard_asked:
            guard.allow(plan.guard_key)  # its counters: a blocked tick, a probe's start
    for s in plan.held:
        assert s.matcher is not None
        s.matcher.defer()
    batch = plan.batch if len(plan.steps) > 1 else None
    for s, step in plan.steps.items():
        if s.controller is not None:
            if step.decision is not None:
                s.controller.commit(step.decision)
            s.controller.overridden(step.shape)
        s.begin_step(step.shape, batch, bare=step.bare)


def _pace(sessions: Sequence[TickSession], prefilling: Sequence[TickSession]) -> tuple[list[TickSession], list[TickSession]]:
    """(decoding, held): the sessions ready to decode, and those whose grammar's masks have had
    more than their share of the engine lately (constraint.Matcher.waiting): these sit the tick out
    while another session steps or reads its prompt (`prefilling`). With no one else to yield to
    they decode."""
    ready = [s for s in sessions if not s.prefilling and not s.done]
    held = [s for s in ready if s.matcher is not None and s.matcher.waiting()]
    if not held:
        return ready, []
    decoding = [s for s in ready if s not in held]
    if not decoding and not prefilling:
        return ready, []
    return decoding, held


def share_masks(sessions: list[TickSession]) -> None:
    """Each request under a grammar gets an equal part of the tick's mask time (constraint.
    MaskLimits.tick_seconds): however many of them a tick holds, their masks together stall it
    for at most that (and one mask each)."""
    matchers = [s.matcher for s in sessions if s.matcher is not None]
    for m in matchers:
        m.allow(len(matchers))


def _guard(engine: TickEngine, plan: Plan, decoding: list[TickSession], cost: CostModel) -> set[TickSession]:
    """The goodput guard (controller/goodput.py): where speculation has measured slower than
    plain decoding at this load level, every auto session decodes plainly this tick (returned),
    without the prompt lookups' and the suffix cache's grafts too (they are speculation: their
    tokens cost verification). The same for the guard's own plain ticks, so that plain is
    measured bare."""
    guard = engine.goodput
    plan.guard_key = key = guard.key(len(decoding), engine.cost.host_factor("target"))
    plan.guard_unit = cost.verify_seconds(len(decoding)) / len(decoding)
    auto = [s for s in decoding if s.controller is not None]
    plan.guard_new = len(decoding) == 1 and not decoding[0].guard_seen  # a request alone: its own evidence
    plan.guard_asked = bool(auto)
    return set(auto) if auto and not guard.allows(key, plan.guard_new) else set()


def pieces(engine: TickEngine, plan: Plan, n_verify: int) -> list[Piece]:
    """The prefill pieces that ride along this tick (plan.prefill), the oldest prompts first while
    the budget lasts. `n_verify`: the decoding sessions' tokens in the forward, grafts included
    (known once the drafts are done), which the budget is priced beside."""
    plan.prefill = []
    if not plan.prefilling:
        return plan.prefill
    cost = engine.cost.at(plan.context, plan.sequences)
    decode = cost.verify_seconds(n_verify) + plan.draft_seconds if n_verify else 0.0
    budget = _piece(engine, cost, n_verify if n_verify else None, decode)
    for s in plan.prefilling:
        toks, start = s.prefill_piece(budget)
        plan.prefill.append((s, toks, start))
        budget -= len(toks)
        if budget < MIN_PIECE:
            break
    return plan.prefill


def first_bare(engine: TickEngine, plan: Plan) -> bool:
    """Whether the first steps riding this tick are held bare (no grafts): the goodput guard has
    fallen back at the tick's load level."""
    key = plan.guard_key
    if key is None:
        key = engine.goodput.key(1, engine.cost.host_factor("target"))
    return engine.goodput.holds(key)


def _piece(engine: TickEngine, cost: CostModel, n_verify: int | None, decode_seconds: float) -> int:
    """Prefill tokens a tick may carry beside `n_verify` verification tokens (None: no session
    decodes) and `decode_seconds` of decode work: the most whose marginal cost on the
    verification curve stays within `prefill_share` times that work."""
    chunk = engine.cfg.target.n_batch
    share = engine.cfg.prefill_share
    if n_verify is None or share <= 0:
        return chunk
    allowed = share * decode_seconds
    base = cost.verify_seconds(n_verify)

    def fits(p: int) -> bool:
        return cost.verify_seconds(n_verify + p) - base <= allowed

    lo, hi = MIN_PIECE, chunk
    if not fits(lo):
        return lo
    while lo < hi:  # the largest piece within the allowance (the curve is non-decreasing)
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _suffix_first(engine: TickEngine, s: TickSession, shape: Shape, cost: CostModel) -> Shape:
    """An auto session whose suffix-cache proposal alone (no draft forward: a plain step with its
    graft) promises more tokens per second than its draft shape decodes plainly this step; the
    proposal still grafts onto whichever tree runs (Session._graft_suffix)."""
    suffix = s.suffix
    if suffix is None or s.controller is None or s.drafter is None or shape.mode == "plain" or s.remaining <= 1:
        return shape
    prop = suffix.look(s.tokens)
    if not prop.tokens:
        return shape
    k = suffix.budget(prop, cost, 1, cost.verify_seconds(1))
    if k <= 0:
        return shape
    rate = (1.0 + suffix.expected(prop, k)) / cost.verify_seconds(1 + k)
    r = _rung_of(engine, s, shape, cost)
    return PLAIN if rate >= r.tokens / _tick_seconds([r], cost) else shape


# -- the joint choice -----------------------------------------------------------------------------

def _rung_of(engine: TickEngine, s: TickSession, shape: Shape, cost: CostModel) -> _Rung:
    """Expected tokens and batch structure of `shape` for session s."""
    catchup = s.drafter.backlog(s.tokens) if s.drafter is not None else 0
    if shape.mode == "plain" or shape.depth <= 0:
        return _Rung(shape, 1.0, 0, ())
    kind = engine.cost_kind(s.drafter_kind)
    ctl = s.controller
    if ctl is not None:
        tokens, expansions = ctl.rung(shape, cost.drafting(kind), catchup)
    else:  # explicit modes keep their shape; the value is not used
        tokens, expansions = 1.0 + 0.5 * shape.nodes, expansion_batches(shape)
    if s.drafter is None:  # n-gram-only speculation drafts for free
        return _Rung(shape, tokens, shape.nodes, ())
    return _Rung(shape, tokens, shape.nodes, (max(1, catchup),) + expansions, kind)



def _ladder(engine: TickEngine, s: TickSession, solo: Shape, cost: CostModel) -> list[_Rung]:
    """Plain, the chains shorter than the session's own choice, then its choice."""
    rungs = [_rung_of(engine, s, PLAIN, cost)]
    if solo.mode == "plain" or solo.depth <= 0:
        return rungs
    depth = solo.depth if solo.mode == "chain" else min(solo.depth, 4)
    for k in range(1, depth):
        rungs.append(_rung_of(engine, s, replace(chain(k, solo.stop_prob), calib=solo.calib,
                                                 stop_levels=solo.stop_levels[:k - 1]), cost))
    rungs.append(_rung_of(engine, s, solo, cost))
    return rungs


def _draft_seconds(batch_lists: list[tuple[int, ...]], cost: CostModel) -> float:
    """Draft forwards of a tick: level l of every session in one forward."""
    depth = max((len(b) for b in batch_lists), default=0)
    total = 0.0
    for level in range(depth):
        n = sum(b[level] for b in batch_lists if len(b) > level)
        if not n:
            continue
        if level == 0:
            rows = sum(1 for b in batch_lists if b)
            total += cost.draft_seconds(n) + (rows - 1) * cost.draft_row
        else:
            total += cost.expand_seconds(n)
    return total


def _tick_seconds(rungs: list[_Rung], cost: CostModel) -> float:
    """One target forward over every rung's tokens, and each drafter's forwards over its rungs'."""
    n = sum(r.nodes + 1 for r in rungs)
    kinds = {r.drafter for r in rungs if r.batches}
    return cost.verify_seconds(n) + sum(_draft_seconds([r.batches for r in rungs if r.drafter == k], cost.drafting(k))
                                        for k in kinds)


def _joint(engine: TickEngine, decoding: list[TickSession], solo: dict[TickSession, Shape],
           cost: CostModel, waiting: int = 0) -> dict[TickSession, Shape]:
    """The auto sessions' shapes chosen together: greedy ascent up their ladders while the
    tick's expected tokens per second grow.

    `waiting`: sessions reading their prompt. Each is a stream whose first token waits for the
    ticks its prompt's pieces ride, so a tick's seconds cost it what they cost a decoding stream:
    it counts as one token of the tick, and the tick's seconds include the piece beside the
    verification (what its tokens add on the curve). While seven prompts are read beside one
    stream, a chain that makes that stream 1.4x faster but every tick 1.4x longer loses; beside
    one prompt it still pays."""
    ladders: dict[TickSession, list[_Rung]] = {}
    for s in decoding:
        if s.controller is not None and solo[s].mode != "plain" and not s.controller.probing:
            ladders[s] = _ladder(engine, s, solo[s], cost)
    if not ladders:
        return solo
    fixed = [_rung_of(engine, s, solo[s], cost) for s in decoding if s not in ladders]
    level = {s: 0 for s in ladders}

    def rate(lv: dict[TickSession, int]) -> float:
        rungs = fixed + [ladders[s][lv[s]] for s in ladders]
        secs = _tick_seconds(rungs, cost)
        if waiting:
            n = sum(r.nodes + 1 for r in rungs)
            secs += cost.extra_seconds(n, _piece(engine, cost, n, secs))
        return (sum(r.tokens for r in rungs) + waiting) / secs

    best = rate(level)
    while True:
        move, move_rate = None, best * (1 + 1e-6)
        for s, lad in ladders.items():
            for j in range(level[s] + 1, len(lad)):
                trial = dict(level)
                trial[s] = j
                r = rate(trial)
                if r > move_rate:
                    move, move_rate = (s, j), r
        if move is None:
            break
        level[move[0]] = move[1]
        best = move_rate
    out = dict(solo)
    for s, lad in ladders.items():
        out[s] = lad[level[s]].shape
    return out
