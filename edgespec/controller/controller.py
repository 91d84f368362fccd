"""Controller: one per request. Before every step `choose()` returns the shape that maximises expected
tokens per second under the measured cost model and this request's acceptance; `observe()` feeds
back what happened. The circuit breaker decides when to stop drafting altogether.

`choose()` is `decide()` then `commit()`: `decide` changes nothing and returns a `Decision` (the
shape, and what choosing it changes here: the breaker's check, the prediction the step's time is
judged against); `commit` applies it once the step begins. A tick's schedule decides for every
session before it knows which steps run (edgespec/tick/schedule.py); its `start` commits.

    closed     -> the argmax over speculative candidates (chains, chain + runner-ups, EAGLE-2 trees)
    open       -> plain (zero drafting) for the cooldown
    half_open  -> a small probe chain, judged on the probes' own acceptance
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from edgespec.controller.acceptance import (
    AcceptancePrior,
    AcceptanceWindow,
    Calibration,
    Counts,
    DropDetector,
    RequestEvidence,
    calib_events,
    estimate,
    step_events,
)
from edgespec.controller.breaker import CLOSED, HALF_OPEN, OPEN, Breaker
from edgespec.controller.config import MAX_WIDTH_LIMIT, ControllerConfig
from edgespec.controller.cost import CostModel
from edgespec.controller.policy import Choice, ShapePolicy, expansion_batches
from edgespec.controller.shapes import PLAIN, Shape, StepOutcome
from edgespec.logs import get_logger

BIAS_ALPHA = 0.2  # EWMA weight of one step in the measured model bias


@dataclass(frozen=True)
class Decision:
    """A step's shape as `Controller.decide` chose it, and what `Controller.commit` then applies.
    One made without the controller (an explicit mode, a request's last token) has no `cost` and
    commits nothing."""

    shape: Shape
    cost: CostModel | None = None  # the cost model at the step's context
    predicted_seconds: float | None = None  # the chosen speculative step's predicted time
    choice: Choice | None = None  # the closed state's best candidate
    check: tuple[float, float] | None = None  # the breaker's closed-state check: (speedup, top-1 acceptance)
    estimate: list[list[float]] | None = None  # the acceptance the check read (kept if it opens)
    catchup_skipped: bool = False  # plain: the draft's backlog would not pay


class Controller:
    def __init__(self, cfg: ControllerConfig, cost: CostModel, prior: AcceptancePrior, *,
                 max_depth: int, max_nodes: int, has_draft_model: bool = True,
                 max_leaves: int | None = None, request_id: str = "", refine_costs: bool = True):
        self.cfg = cfg
        # False when the engine observes the shared cost model itself (a batched tick times the
        # forwards of all its sessions at once; a step's own share is not a forward)
        self.refine_costs = refine_costs
        self.cost = cost
        self.prior = prior
        self.policy = ShapePolicy(cfg, max_depth=max_depth, max_nodes=max_nodes,
                                  has_draft_model=has_draft_model, max_leaves=max_leaves)
        D, R = self.policy.max_depth, min(cfg.max_width, MAX_WIDTH_LIMIT)
        self._depths, self._ranks = D, R
        self._prior = prior.view(D, R)
        self.window = AcceptanceWindow(cfg.window, D, R, cfg.decay)
        self.probe_window = AcceptanceWindow(cfg.probe_steps, D, R)
        self.request_counts = Counts(D, R)  # the whole request, for the cross-request prior
        self.calibration = Calibration(list(prior.calib), cfg.prior_weight)
        self.breaker = Breaker(cfg, request_id)
        self.breaker.cooldown = min(cfg.max_cooldown_tokens, int(round(cfg.cooldown_tokens * prior.cooldown_scale)))
        self.drift = DropDetector(cfg.drift_threshold, cfg.drift_drop)
        self.drift_alarms = 0
        self._log = get_logger("edgespec.controller")
        self._request_id = request_id
        self.disabled = not self.policy.has_speculative
        self.steps = 0
        self.tokens = 0
        self.steps_per_mode: dict[str, int] = {}
        self.steps_per_kind: dict[str, int] = {}
        self.last_shape: Shape = PLAIN
        self.last_speculative_shape: Shape | None = None
        self.last_choice: Choice | None = None
        self.catchup = 1  # draft batch of the first draft forward (measured)
        self.catchup_skips = 0  # closed-state steps decoded plainly: the draft's backlog would not pay
        self._cost = cost  # the cost model at the current step's context (choose)
        self._prev_speculative = False
        self._overhead = {"plain": 0.0, "spec": 0.0}
        self._open_estimate = self._prior  # the estimate the breaker last opened on
        # realized / predicted seconds of closed-state speculative steps (EWMA): corrects the
        # analytic model for whatever it does not see (cache effects at long contexts, catch-up,
        # Python work that scales with the shape), so the breaker acts on measured speed
        self.spec_bias = prior.spec_bias
        self.bias_steps = 0
        self._predicted_seconds: float | None = None

    # ------------------------------------------------------------------ decisions
    @property
    def state(self) -> str:
        return OPEN if self.disabled else self.breaker.state

    def acceptance(self, window: AcceptanceWindow | None = None) -> list[list[float]]:
        """a[depth-1][rank]. The probe window is blended with the estimate the breaker opened on, so a
        probe must show real acceptance to close it (the cross-request prior would be too kind)."""
        if window is self.probe_window:
            return estimate(window.counts, self._open_estimate, self.cfg.prior_weight)
        return estimate((window or self.window).counts, self._prior, self.cfg.prior_weight)

    def _best(self, window: AcceptanceWindow | None = None, cost: CostModel | None = None) -> Choice:
        return self.policy.best(self.acceptance(window), cost if cost is not None else self._cost,
                                catchup=self.catchup, overhead_spec=self._overhead["spec"],
                                overhead_plain=self._overhead["plain"])

    def _speedup(self, choice: Choice) -> float:
        """Expected speedup over plain, corrected by the measured bias of the step-time model."""
        return choice.speedup / self.spec_bias

    def choose(self, remaining: int | None = None, draft_backlog: int = 0, context: int = 0,
               emitted: int | None = None) -> Shape:
        """The shape of the next step, decided and committed (`decide`, `commit`)."""
        decision = self.decide(remaining, draft_backlog, context, emitted)
        self.commit(decision)
        return decision.shape

    def decide(self, remaining: int | None = None, draft_backlog: int = 0, context: int = 0,
               emitted: int | None = None) -> Decision:
        """The shape of the next step, and what choosing it changes (`commit` applies it); changes
        nothing itself. Cheap: one analytic pass over a fixed candidate set.
        `remaining`: tokens the request may still emit; `draft_backlog`: context tokens the draft
        model has not absorbed (after a plain phase its first forward must catch up on them);
        `context`: tokens in the target's cache (a long one makes every verified token dearer);
        `emitted`: tokens the request has emitted (0: its first step, plain if `first_token_plain`)."""
        cost = self.cost.at(context)
        predicted, choice, check, a, skipped = None, None, None, None, False
        if self.disabled or self.breaker.state == OPEN:
            shape = PLAIN
        elif emitted == 0 and self.cfg.first_token_plain:
            shape = PLAIN
        elif self.breaker.state == HALF_OPEN:
            shape = self.policy.probe_shape() if self._probe_pays(remaining, draft_backlog, cost) else PLAIN
        else:
            choice = self._best(cost=cost)
            a = self.acceptance()
            speedup = self._speedup(choice)
            check = (speedup, round(a[0][0], 4))
            if self.breaker.opens(speedup, self.steps):
                shape = PLAIN
            elif not self._catchup_pays(remaining, draft_backlog, choice, cost):
                skipped = True
                shape = PLAIN
            else:
                shape = choice.shape
                predicted = choice.seconds
                levels = self.policy.stop_levels(shape, a, cost, choice.rate)
                if levels:
                    shape = replace(shape, stop_levels=levels)
        if shape.mode != "plain" and shape.stop_prob > 0 and self.cfg.calibrate_stop:
            shape = replace(shape, calib=self.calibration.rates())
        return Decision(shape, cost, predicted, choice, check, a, skipped)

    def commit(self, decision: Decision) -> None:
        """Apply a decision of this controller as its step begins: the cost model at the step's
        context, the prediction, the breaker's closed-state check (which may open it, as
        `decide` foresaw), the shape. Commit a decision in the state it was decided in."""
        if decision.cost is None:
            return
        self._cost = decision.cost
        self._predicted_seconds = decision.predicted_seconds
        if decision.choice is not None:
            self.last_choice = decision.choice
        if decision.check is not None:
            speedup, top1 = decision.check
            if self.breaker.closed_check(speedup, self.tokens, self.steps, top1_acceptance=top1):
                assert decision.estimate is not None  # set with the check
                self._open_estimate = decision.estimate
        if decision.catchup_skipped:
            self.catchup_skips += 1
        self.last_shape = decision.shape

    def rung(self, shape: Shape, cost: CostModel, catchup: int = 1) -> tuple[float, tuple[int, ...]]:
        """What `shape` is worth to this request, for a schedule pricing a whole tick: expected
        emitted tokens under this request's acceptance, and the draft batch of each forward after
        the catch-up (tree expansions)."""
        a = self.acceptance()
        tokens, _ = self.policy.evaluate(shape, a, cost, catchup=max(1, catchup))
        return tokens, expansion_batches(shape, a)

    @property
    def probing(self) -> bool:
        """The breaker is half-open: the next speculative steps are its probes."""
        return self.breaker.state == HALF_OPEN

    def overridden(self, shape: Shape) -> None:
        """The engine ran `shape` instead of the one chosen (a batched tick shrank it under load):
        the step's time is then no test of the chosen shape's predicted time."""
        if shape != self.last_shape:
            self.last_shape = shape
            self._predicted_seconds = None

    def _catchup_pays(self, remaining: int | None, draft_backlog: int, choice: Choice, cost: CostModel) -> bool:
        """Before its first proposal the draft absorbs what it lacks: at a request's start the
        whole prompt (up to the engine's draft window). Speculate only if the saving the choice
        promises over the tokens still to come covers that one-off; else decode plainly (prompt
        lookups still graft) and ask again next step. With a short answer to a long prompt the
        draft is never run."""
        if remaining is None or draft_backlog <= self.catchup + 1 or choice.shape.mode == "plain" \
                or not self.policy.has_draft_model:
            return True
        extra = cost.draft_seconds(draft_backlog) - cost.draft_seconds(self.catchup)
        speedup = self._speedup(choice)
        if speedup <= 1.0:
            return False
        plain_token = cost.verify_seconds(1) + self._overhead["plain"]
        return extra <= remaining * plain_token * (1.0 - 1.0 / speedup)

    def _probe_pays(self, remaining: int | None, draft_backlog: int, cost: CostModel) -> bool:
        """A probe first makes the draft absorb the plain phase's backlog (one forward over it). On
        a short remainder that one-off can cost more than the probe could ever win back: skip the
        probe (the breaker stays half-open, decoding plainly) when it would cost more than
        `probe_cost_fraction` of the remaining plain decoding."""
        if remaining is None or draft_backlog <= 1 or not self.policy.has_draft_model:
            return True
        catchup = cost.draft_seconds(draft_backlog)
        return catchup <= self.cfg.probe_cost_fraction * remaining * cost.verify_seconds(1)

    def _top1(self, window: AcceptanceWindow | None = None) -> float:
        return self.acceptance(window)[0][0]

    # ------------------------------------------------------------------ feedback
    def observe(self, outcome: StepOutcome) -> None:
        self.steps += 1
        self.tokens += outcome.emitted
        mode, kind = outcome.shape.mode, outcome.shape.kind
        self.steps_per_mode[mode] = self.steps_per_mode.get(mode, 0) + 1
        self.steps_per_kind[kind] = self.steps_per_kind.get(kind, 0) + 1
        self._refine_costs(outcome)

        if not outcome.speculative:
            self._prev_speculative = False
            self.breaker.plain_tokens(outcome.emitted, self.tokens, self.steps)
            return

        self.last_speculative_shape = outcome.shape
        if self._predicted_seconds and self._prev_speculative:
            realized = outcome.draft_seconds + outcome.verify_seconds + outcome.overhead_seconds
            ratio = min(4.0, max(0.25, realized / self._predicted_seconds))
            self.spec_bias += BIAS_ALPHA * (ratio - self.spec_bias)
            self.bias_steps += 1
        if self._prev_speculative and outcome.draft_batches:
            # the first draft forward absorbs what the draft lacks from the previous step (not the
            # backlog of a plain phase, which is a one-off)
            self.catchup = max(1, outcome.draft_batches[0])
        self._prev_speculative = True
        events = step_events(outcome, self._depths, self._ranks)
        self.request_counts.add(events)
        self.calibration.add(calib_events(outcome.spine_probs, outcome.accepted_ranks))
        if self.breaker.state == HALF_OPEN:
            self.probe_window.add(events)
            if self.breaker.probe_step_done():
                choice = self._best(self.probe_window)
                self.breaker.probe_result(self._speedup(choice), self.tokens, self.steps,
                                          top1_acceptance=round(self._top1(self.probe_window), 4))
                if self.breaker.state == OPEN:
                    self._open_estimate = self.acceptance(self.probe_window)
                if self.breaker.state == CLOSED:
                    self.drift.reset()
                    # what came before the breaker opened describes text no longer being generated
                    self.window.replace_with(self.probe_window)
                self.probe_window.clear()
        else:
            if self.breaker.state == CLOSED and outcome.offered and outcome.offered[0] > 0:
                p0 = self.acceptance()[0][0]
                run = self.drift.update(bool(outcome.accepted_ranks) and outcome.accepted_ranks[0] == 0, p0)
            else:
                run = 0
            self.window.add(events)
            if run:
                self.window.keep_last(run)
                self.drift_alarms += 1
                self._log.info("acceptance_drift", request_id=self._request_id, token=self.tokens,
                               step=self.steps, window_estimate=round(p0, 4), kept_steps=run)
            if self.breaker.state == CLOSED:
                self.breaker.closed_step_done()

    def _refine_costs(self, o: StepOutcome) -> None:
        if self.refine_costs:
            self.cost.observe_step(o.verify_tokens, o.verify_seconds, o.draft_batches, o.draft_seconds,
                                   context=o.context)
        if o.overhead_seconds > 0:
            key = "spec" if o.speculative else "plain"
            a = self.cfg.ewma_alpha
            self._overhead[key] += a * (o.overhead_seconds - self._overhead[key]) if self._overhead[key] else o.overhead_seconds

    # ------------------------------------------------------------------ reporting
    def evidence(self) -> RequestEvidence:
        """What this request tells the cross-request prior (AcceptancePrior.update_from)."""
        cfg = self.cfg
        return RequestEvidence(
            counts=self.request_counts, calibration=self.calibration,
            probe_results=tuple(t.dst for t in self.breaker.transitions if t.src == HALF_OPEN),
            cooldown_tokens=cfg.cooldown_tokens, max_cooldown_tokens=cfg.max_cooldown_tokens,
            cooldown_growth=cfg.cooldown_growth, spec_bias=self.spec_bias, bias_steps=self.bias_steps,
        )

    def summary(self) -> dict:
        a = self.acceptance()
        lc = self.last_choice
        return {
            "state": self.state,
            "disabled": self.disabled,
            "steps": self.steps,
            "tokens": self.tokens,
            "steps_per_mode": dict(self.steps_per_mode),
            "steps_per_kind": dict(self.steps_per_kind),
            "breaker_transitions": len(self.breaker.transitions),
            "transitions": [t.as_dict() for t in self.breaker.transitions],
            "final_shape": self.last_shape.as_dict(),
            "final_speculative_shape": self.last_speculative_shape.as_dict() if self.last_speculative_shape else None,
            "expected_speedup": round(self._speedup(lc), 4) if lc else None,
            "verify_width": lc.verify_width if lc else None,
            "model_bias": round(self.spec_bias, 4),
            "cooldown_tokens": self.breaker.cooldown,
            "acceptance_top1_by_depth": [round(row[0], 4) for row in a],
            "candidates": self.policy.n_candidates,
            "drift_alarms": self.drift_alarms,
            "catchup_skips": self.catchup_skips,
            "draft_calibration": [round(x, 3) for x in self.calibration.rates()],
        }
