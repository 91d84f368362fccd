"""Per-request circuit breaker: closed (speculating) / open (plain decoding, zero drafting) /
half-open (probing with a small speculation).

- closed -> open: the best speculative shape's expected speedup over plain (from the measured costs
  and this request's acceptance) stayed below 1 - open_margin for open_after_steps consecutive
  steps, and the breaker has been closed for at least min_dwell_steps steps.
- open -> half_open: after `cooldown` tokens decoded plainly.
- half_open -> closed: after probe_steps probe steps, the expected speedup computed from the
  probes' acceptance is above 1 + close_margin; the cooldown is reset.
- half_open -> open: otherwise; the cooldown grows by cooldown_growth, capped at max_cooldown_tokens.
The two thresholds (1 - open_margin < 1 + close_margin), the patience and the dwell are the hysteresis.
Every transition is logged with its reason and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgespec.controller.config import ControllerConfig
from edgespec.logs import get_logger

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True)
class Transition:
    src: str
    dst: str
    reason: str
    token: int  # tokens emitted by the request when it happened
    step: int
    speedup: float | None = None

    def as_dict(self) -> dict[str, Any]:
        d = {"from": self.src, "to": self.dst, "reason": self.reason, "token": self.token, "step": self.step}
        if self.speedup is not None:
            d["expected_speedup"] = round(self.speedup, 4)
        return d


class Breaker:
    def __init__(self, cfg: ControllerConfig, request_id: str = ""):
        self.cfg = cfg
        self.state = CLOSED
        self.steps_in_state = 0  # closed: speculative steps since closing; half-open: probe steps
        self.below = 0  # consecutive closed-state evaluations below the open threshold
        self.cooldown = cfg.cooldown_tokens
        self.open_tokens = 0  # tokens decoded since opening
        self.transitions: list[Transition] = []
        self.counts: dict[str, int] = {}
        self._log = get_logger("edgespec.controller")
        self._request_id = request_id

    @property
    def open_threshold(self) -> float:
        return 1.0 - self.cfg.open_margin

    @property
    def close_threshold(self) -> float:
        return 1.0 + self.cfg.close_margin

    def _go(self, dst: str, reason: str, token: int, step: int, speedup: float | None, **detail: Any) -> None:
        t = Transition(self.state, dst, reason, token, step, speedup)
        self.transitions.append(t)
        key = f"{self.state}->{dst}"
        self.counts[key] = self.counts.get(key, 0) + 1
        self._log.info("breaker_transition", request_id=self._request_id, **t.as_dict(), **detail)
        self.state = dst
        self.steps_in_state = 0
        self.below = 0
        if dst == OPEN:
            self.open_tokens = 0

    def opens(self, speedup: float, step: int) -> bool:
        """Whether `closed_check` with this speedup at `step` opens the breaker. Changes nothing."""
        below = self.below + 1 if speedup < self.open_threshold else 0
        return (below >= self.cfg.open_after_steps and self.steps_in_state >= self.cfg.min_dwell_steps) or (
            step == 0 and not self.transitions and speedup < 1.0)

    def closed_check(self, speedup: float, token: int, step: int, **detail: Any) -> bool:
        """Called before a closed-state step with the best expected speedup; True if it opened
        (as `opens` foretells)."""
        assert self.state == CLOSED
        self.below = self.below + 1 if speedup < self.open_threshold else 0
        if self.below >= self.cfg.open_after_steps and self.steps_in_state >= self.cfg.min_dwell_steps:
            reason = (f"expected speedup {speedup:.3f} < {self.open_threshold:.3f} "
                      f"for {self.below} steps")
            self._go(OPEN, reason, token, step, speedup, **detail)
            return True
        if step == 0 and not self.transitions and speedup < 1.0:
            # a new request whose prior (learnt on this machine) says drafting does not pay starts
            # plain: no hysteresis is owed before the first transition. The half-open probe after
            # the cooldown re-checks on this request's own text
            self._go(OPEN, f"prior expected speedup {speedup:.3f} < 1 at the start", token, step, speedup, **detail)
            return True
        return False

    def closed_step_done(self) -> None:
        self.steps_in_state += 1

    def plain_tokens(self, n: int, token: int, step: int) -> None:
        """Tokens decoded while open; moves to half-open when the cooldown has elapsed."""
        if self.state != OPEN:
            return
        self.open_tokens += n
        if self.open_tokens >= self.cooldown:
            self._go(HALF_OPEN, f"cooldown of {self.cooldown} tokens elapsed", token, step, None)

    def probe_step_done(self) -> bool:
        """Count one probe step; True when the probe is complete and must be judged."""
        self.steps_in_state += 1
        return self.steps_in_state >= self.cfg.probe_steps

    def probe_result(self, speedup: float, token: int, step: int, **detail: Any) -> None:
        assert self.state == HALF_OPEN
        if speedup > self.close_threshold:
            reason = f"probe expected speedup {speedup:.3f} > {self.close_threshold:.3f}"
            self.cooldown = self.cfg.cooldown_tokens
            self._go(CLOSED, reason, token, step, speedup, **detail)
        else:
            reason = f"probe expected speedup {speedup:.3f} <= {self.close_threshold:.3f}"
            self.cooldown = min(self.cfg.max_cooldown_tokens, int(round(self.cooldown * self.cfg.cooldown_growth)))
            self._go(OPEN, reason, token, step, speedup, next_cooldown_tokens=self.cooldown, **detail)
