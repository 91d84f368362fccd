"""The controller and its breaker driven by a scripted drafter (edgespec.controller.sim) on the measured
CPU cost curves (F32 target, Q4_0 draft) and a GPU-like model. Fast and seeded."""

import pytest

from edgespec.controller import (
    AcceptancePrior,
    Controller,
    ControllerConfig,
    plain_outcome,
)
from edgespec.controller.sim import ScriptedDrafter, cpu_cost, gpu_cost, simulate

SEEDS = range(5)
# Stated bounds (defaults: window 32, drift_threshold 4, open_after_steps 2, min_dwell_steps 4,
# cooldown_tokens 32, probe_steps 3, open_margin 0.1, close_margin 0.05):
OPEN_WITHIN = 10  # steps after acceptance collapses from 0.9 to 0 (measured 5-7 on the CPU curves)
FLAP_MAX = 3  # transitions in 500 steps of steady 50 % acceptance (at most one open/probe/close cycle)


def make(cost_fn=cpu_cost, cfg=None, prior=None, **kw):
    kw.setdefault("max_depth", 16)
    kw.setdefault("max_nodes", 64)
    return Controller(cfg or ControllerConfig(), cost_fn(), prior or AcceptancePrior(), **kw)


def first(states, start, want):
    return next(i - start for i in range(start, len(states)) if states[i] == want)


@pytest.mark.parametrize("seed", SEEDS)
def test_high_zero_high_opens_stays_plain_and_recovers(seed):
    cfg = ControllerConfig()
    ctrl = make(cfg=cfg)
    back = 120  # acceptance returns before the first probe
    script = ScriptedDrafter(lambda s: 0.9 if s < 100 or s >= back else 0.0)
    res = simulate(ctrl, script, cpu_cost(), steps=260, seed=seed)
    st = res.states
    assert all(x == "closed" for x in st[:100])  # no spurious opening while acceptance is high
    opened = first(st, 100, "open")
    assert opened <= OPEN_WITHIN
    # open = plain decoding, zero drafting
    for i, x in enumerate(st):
        if x == "open":
            assert res.kinds[i] == "plain" and res.draft_forwards[i] == 0
    # recovers within one cooldown + one probe after acceptance returns, then stays closed
    recovered = first(st, back, "closed")
    assert recovered <= cfg.cooldown_tokens + cfg.probe_steps + 1
    assert all(x == "closed" for x in st[back + recovered :])
    s = ctrl.summary()
    assert [(t["from"], t["to"]) for t in s["transitions"]] == [
        ("closed", "open"), ("open", "half_open"), ("half_open", "closed")]
    assert s["breaker_transitions"] == 3
    assert "expected speedup" in s["transitions"][0]["reason"]
    assert s["transitions"][0]["token"] > 0
    assert s["steps_per_mode"]["plain"] >= cfg.cooldown_tokens


def test_long_outage_probes_with_growing_cooldown():
    cfg = ControllerConfig()
    ctrl = make(cfg=cfg)
    res = simulate(ctrl, ScriptedDrafter(lambda s: 0.9 if s < 50 or s >= 400 else 0.0), cpu_cost(), steps=900)
    tr = ctrl.summary()["transitions"]
    failed = [t for t in tr if t["from"] == "half_open" and t["to"] == "open"]
    assert len(failed) >= 2
    gaps = [b["token"] - a["token"] for a, b in zip(tr, tr[1:]) if a["to"] == "open"]
    assert gaps == sorted(gaps) and gaps[-1] > cfg.cooldown_tokens  # backs off
    assert max(gaps) <= cfg.max_cooldown_tokens
    assert tr[-1]["to"] == "closed" and res.states[-1] == "closed"


@pytest.mark.parametrize("seed", SEEDS)
def test_steady_half_acceptance_does_not_flap(seed):
    ctrl = make()
    res = simulate(ctrl, ScriptedDrafter(lambda s: 0.5), cpu_cost(), steps=500, seed=seed)
    assert ctrl.summary()["breaker_transitions"] <= FLAP_MAX
    assert res.speedup > 1.0  # at 50 % a short chain still pays on the CPU curves


@pytest.mark.parametrize("cost_fn", [cpu_cost, gpu_cost])
@pytest.mark.parametrize("backlog_cap", [0, 64])
def test_useless_drafter_goes_plain_fast_and_costs_under_5_percent(cost_fn, backlog_cap):
    ctrl = make(cost_fn)
    res = simulate(ctrl, ScriptedDrafter(lambda s: 0.0), cost_fn(), tokens=1000, backlog_cap=backlog_cap)
    first_open = first(res.states, 0, "open")
    assert first_open <= (10 if cost_fn is cpu_cost else 40)  # GPU break-even acceptance is lower
    assert res.speedup >= 0.95
    assert res.kinds.count("plain") > 0.9 * res.steps


def test_high_acceptance_speedup_and_shapes():
    cpu = make(cpu_cost)
    r_cpu = simulate(cpu, ScriptedDrafter(lambda s: 0.9), cpu_cost(), steps=200)
    gpu = make(gpu_cost)
    r_gpu = simulate(gpu, ScriptedDrafter(lambda s: 0.9), gpu_cost(), steps=200)
    assert r_cpu.speedup > 1.2 and r_gpu.speedup > 2.0
    s_cpu, s_gpu = cpu.summary()["final_shape"], gpu.summary()["final_shape"]
    assert s_cpu["kind"] in ("chain", "runner_ups")
    assert s_gpu["nodes"] > s_cpu["nodes"] and s_gpu["mode"] == "tree"
    assert cpu.summary()["breaker_transitions"] == 0


def test_summary_and_stats_shape():
    ctrl = make()
    simulate(ctrl, ScriptedDrafter(lambda s: 0.8), cpu_cost(), steps=20)
    s = ctrl.summary()
    for key in ("steps_per_mode", "breaker_transitions", "transitions", "final_shape", "state"):
        assert key in s
    assert sum(s["steps_per_mode"].values()) == 20
    assert s["final_shape"]["depth"] >= 1 and s["final_shape"]["width"] >= 1
    assert s["state"] == ctrl.state == "closed"


def test_disabled_controller_is_plain_without_transitions():
    cfg = ControllerConfig(enable_chain=False, enable_tree=False, enable_runner_ups=False)
    ctrl = make(cfg=cfg)
    for _ in range(50):
        assert ctrl.choose().mode == "plain"
        ctrl.observe(plain_outcome(0.036))
    assert ctrl.state == "open" and ctrl.summary()["breaker_transitions"] == 0


def test_no_draft_model_uses_free_ngram_chains():
    ctrl = make(has_draft_model=False, max_depth=6, max_nodes=16)
    assert ctrl.choose().mode == "chain"


def test_choose_is_cheap():
    ctrl = make(gpu_cost)
    ctrl.choose()
    assert ctrl.last_choice.evaluated == ctrl.policy.n_candidates <= 300
    # open and half-open choices do not evaluate candidates at all
    ctrl.breaker.state = "open"
    ctrl.last_choice = None
    assert ctrl.choose().mode == "plain" and ctrl.last_choice is None


def test_cost_model_is_refined_from_outcomes():
    cost = cpu_cost()
    ctrl = Controller(ControllerConfig(), cost, AcceptancePrior(), max_depth=8, max_nodes=16)
    before = cost.verify_seconds(1)
    for _ in range(50):
        ctrl.observe(plain_outcome(before * 2))
    assert cost.verify_seconds(1) > 1.8 * before


def test_prior_learns_from_a_finished_request():
    prior = AcceptancePrior()
    ctrl = Controller(ControllerConfig(), cpu_cost(), prior, max_depth=8, max_nodes=16)
    simulate(ctrl, ScriptedDrafter(lambda s: 0.2), cpu_cost(), steps=30)
    before = prior.rates[0][0]
    prior.update_from(ctrl.evidence())
    assert prior.rates[0][0] < before and prior.requests == 1


def test_failed_probes_lengthen_the_next_requests_cooldown():
    """Across requests: probes that keep failing make later requests wait longer (capped); a
    successful probe resets it."""
    from edgespec.controller import AcceptancePrior

    cfg = ControllerConfig()
    prior = AcceptancePrior()
    ctrl = make(cfg=cfg, prior=prior)
    simulate(ctrl, ScriptedDrafter(lambda s: 0.0), cpu_cost(), steps=200)
    assert any(t["from"] == "half_open" and t["to"] == "open" for t in ctrl.summary()["transitions"])
    prior.update_from(ctrl.evidence())
    second = make(cfg=cfg, prior=prior)
    assert cfg.cooldown_tokens < second.breaker.cooldown <= cfg.max_cooldown_tokens


def test_probe_skipped_when_the_draft_catch_up_would_cost_more_than_the_rest_can_win():
    """Half-open: a probe makes the draft absorb the plain phase's backlog in one forward. With
    few tokens left that one-off is not worth it: the controller stays plain (still half-open)
    until the cost is small against what remains; the default (no remaining given) probes."""
    cfg = ControllerConfig()
    ctrl = make(cfg=cfg)
    simulate(ctrl, ScriptedDrafter(lambda s: 0.0), cpu_cost(), steps=OPEN_WITHIN + 2)
    assert ctrl.state == "open"
    while ctrl.state == "open":
        ctrl.observe(plain_outcome(ctrl.cost.verify_seconds(1)))
    assert ctrl.state == "half_open"
    cost = ctrl.cost
    backlog = 200
    catchup = cost.draft_seconds(backlog)
    few = int(catchup / (cfg.probe_cost_fraction * cost.verify_seconds(1))) - 1  # just too few
    assert few > 0
    assert ctrl.choose(remaining=few, draft_backlog=backlog).mode == "plain"
    assert ctrl.state == "half_open"
    assert ctrl.choose(remaining=few + 2, draft_backlog=backlog).mode != "plain"
    assert ctrl.choose(remaining=1, draft_backlog=1).mode != "plain"  # nothing to catch up
    assert ctrl.choose().mode != "plain"


def test_stop_rule_uses_the_learnt_calibration():
    """auto's shapes carry the calibration the drafter's early stop multiplies along a path; it is
    learnt from the first-choice tokens verification reached (StepOutcome.spine_probs)."""
    from edgespec.controller import StepOutcome, chain

    ctrl = make()
    shape = ctrl.choose()
    assert shape.mode != "plain" and shape.stop_prob == 0.6
    assert shape.calib == ctrl.calibration.rates() and len(shape.calib) == 10
    assert shape.accept_estimate(0.35) == shape.calib[3]
    before = shape.accept_estimate(0.35)
    for _ in range(40):  # an unsure draft (p = 0.35 at every level) whose 4-chains are always accepted
        ctrl.observe(StepOutcome(chain(4), (0, 0, 0, 0), (1, 1, 1, 1, 0), 5, 0.02, (1, 1, 1, 1), 0.015, 5, 4,
                                 spine_probs=(0.35,) * 4))
    after = ctrl.choose().accept_estimate(0.35)
    assert before < 0.4 and after > 0.95
    assert ctrl.summary()["draft_calibration"][3] == round(after, 3)
    # off: the drafter compares the draft's raw path probability
    raw = make(cfg=ControllerConfig(calibrate_stop=False)).choose()
    assert raw.calib == () and raw.accept_estimate(0.35) == 0.35


def test_no_speculation_when_the_drafts_prompt_catch_up_would_not_pay():
    """At a request's start the draft must absorb the prompt (up to the engine's draft window)
    before it drafts. The controller speculates only when the expected saving over the tokens
    still to come covers that one-off; otherwise it decodes plainly without opening the breaker,
    counts the step, and asks again next step."""
    ctrl = make()
    cost = ctrl.cost
    backlog = 256
    extra = cost.draft_seconds(backlog) - cost.draft_seconds(1)
    choice = ctrl._best()
    s = ctrl._speedup(choice)
    assert s > 1.2
    breakeven = extra / (cost.verify_seconds(1) * (1 - 1 / s))
    few, many = int(breakeven * 0.8), int(breakeven * 1.25) + 1
    assert ctrl.choose(remaining=few, draft_backlog=backlog).mode == "plain"
    assert ctrl.state == "closed" and ctrl.summary()["catchup_skips"] == 1
    assert ctrl.choose(remaining=many, draft_backlog=backlog).mode != "plain"
    assert ctrl.choose(remaining=few, draft_backlog=1).mode != "plain"  # nothing to catch up
    assert ctrl.choose(draft_backlog=backlog).mode != "plain"  # no remainder known: speculate


def test_a_long_context_makes_verification_dearer_in_the_choice():
    """The same acceptance at 8000 tokens of context: every verified token costs more there
    (attention), so the controller expects less and chooses no bigger a shape."""
    ctrl = make()
    for i in range(100):
        n, ctx = (1, 3, 6)[i % 3], 1000 + 70 * i
        extra = (ctx - 32) * (2e-6 + 0.8e-6 * (n - 1))
        ctrl.cost.observe("target", n, ctrl.cost.verify_seconds(n) + extra, context=ctx)
    short = ctrl.choose(context=100)
    s_short = ctrl._speedup(ctrl.last_choice)
    long_ = ctrl.choose(context=8000)
    s_long = ctrl._speedup(ctrl.last_choice)
    assert s_long < s_short
    assert long_.nodes <= short.nodes


def test_first_step_is_plain_then_speculation():
    """A request's first step decodes plainly (its first token after one target forward, like plain
    decoding's), whatever the estimate; from the second step on the controller chooses as usual.
    `first_token_plain = false` speculates from the first step."""
    ctrl = make()
    assert ctrl._speedup(ctrl._best()) > 1.2  # speculation would pay
    assert ctrl.choose(remaining=100, emitted=0).mode == "plain"
    assert ctrl.state == "closed" and ctrl.summary()["catchup_skips"] == 0
    assert ctrl.choose(remaining=99, emitted=1).mode != "plain"
    off = make(cfg=ControllerConfig(first_token_plain=False))
    assert off.choose(remaining=100, emitted=0).mode != "plain"


def test_decide_changes_nothing_and_commit_applies_it():
    """choose() is decide() then commit(): decide leaves the controller as it was (the breaker's
    check, the prediction, the counters), and a controller driven by the two halves walks the
    same states and shapes as one driven by choose, through an opening and a recovery."""

    class TwoPhase(Controller):
        def choose(self, remaining=None, draft_backlog=0, context=0, emitted=None):
            def seen():
                return (self.state, self.breaker.below, self.last_shape, self.last_choice, self.catchup_skips,
                        self._predicted_seconds, len(self.breaker.transitions))

            before = seen()
            d = self.decide(remaining, draft_backlog, context, emitted)
            assert seen() == before and self.decide(remaining, draft_backlog, context, emitted).shape == d.shape
            self.commit(d)
            return d.shape

    def script():
        return ScriptedDrafter(lambda s: 0.9 if s < 100 or s >= 120 else 0.0)

    one = make()
    two = TwoPhase(ControllerConfig(), cpu_cost(), AcceptancePrior(), max_depth=16, max_nodes=64)
    a = simulate(one, script(), cpu_cost(), steps=260, seed=1)
    b = simulate(two, script(), cpu_cost(), steps=260, seed=1)
    assert (a.states, a.kinds) == (b.states, b.kinds)
    assert "open" in a.states
    assert one.summary() == two.summary()
