"""The acceptance model: a[d][r] = P(the candidate of sibling rank r at depth d is accepted | its parent
was reached and the candidates of ranks < r were rejected).

Counts come from the accepted path of each step (StepOutcome.accepted_ranks / offered): at every
node on the path, the ranks below the accepted one were tried and rejected, the accepted rank was
tried and accepted; at the node where verification stopped every offered child was rejected.

Estimate (two-level shrinkage, W = prior_weight):
    level[r]   = (acc[1][r] + W*prior[1][r]) / (trials[1][r] + W)       # this request at depth 1
    base[d][r] = min(0.995, prior[d][r] * level[r] / prior[1][r])        # prior's depth profile, shifted
    a[d][r]    = (acc[d][r] + W*base[d][r]) / (trials[d][r] + W)
Depth 1 sees a trial in every speculative step, so it moves first when the text drifts; deeper
depths follow through `base` until they have their own evidence.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from edgespec.controller.shapes import StepOutcome
from edgespec.shape import calib_bucket

Event = tuple[int, int, int]  # (depth index 0-based, rank, accepted 0/1)

# Default prior before any request finished: top-1 agreement ~0.75 (measured 0.65-0.88), and
# conditional acceptance of the runner-ups giving top-4 ~0.92 (measured 0.87-0.98).
DEFAULT_RANK_ACCEPTANCE = (0.75, 0.35, 0.30, 0.25, 0.20, 0.20, 0.20, 0.20)

# Confidence calibration: buckets of the draft's probability for its first-choice token.
CALIB_BUCKETS = 10


def calib_events(spine_probs: Iterable[float], accepted_ranks: tuple[int, ...]) -> list[tuple[int, int]]:
    """(bucket, accepted 0/1) of each first-choice draft token verification reached: the token at
    level d is tried when the first choices of levels < d were all accepted."""
    ev = []
    for d, p in enumerate(spine_probs):
        if d > len(accepted_ranks) or any(r != 0 for r in accepted_ranks[:d]):
            break
        b = calib_bucket(p, CALIB_BUCKETS)
        ev.append((b, int(d < len(accepted_ranks) and accepted_ranks[d] == 0)))
    return ev


@dataclass(frozen=True)
class RequestEvidence:
    """What one finished request tells the cross-request prior (Controller.evidence())."""

    counts: Counts  # the whole request's (depth, rank) trials and accepts
    calibration: Calibration  # its first-choice acceptance by draft probability
    probe_results: tuple[str, ...]  # where each half-open probe went: "closed" or "open"
    cooldown_tokens: int  # the configured cooldown, its cap and growth per failed probe
    max_cooldown_tokens: int
    cooldown_growth: float
    spec_bias: float  # the measured/predicted step-time ratio, over bias_steps steps
    bias_steps: int


class Calibration:
    """P(a first-choice draft token is accepted | the draft's probability p for it), by bucket of p.

    The draft's own probability is a poor acceptance estimate unless the draft is calibrated
    against the target: an 8-bit copy of the target is accepted ~97 % of the time even where it
    gives its choice p = 0.4 (the target's argmax is the same), a weak draft far less often than
    its p. Early stopping (`stop_prob`) multiplies these estimates along a path instead of p.
    Estimate per bucket: (accepted + W*prior) / (trials + W) over this request's steps."""

    def __init__(self, prior: list[float], weight: float):
        self.prior, self.weight = prior, weight
        self.trials = [0.0] * CALIB_BUCKETS
        self.accepts = [0.0] * CALIB_BUCKETS
        self._rates: tuple[float, ...] | None = None

    def add(self, events: Iterable[tuple[int, int]]) -> None:
        for b, hit in events:
            self.trials[b] += 1
            self.accepts[b] += hit
            self._rates = None

    def rates(self) -> tuple[float, ...]:
        if self._rates is None:
            w = self.weight
            self._rates = tuple(
                (a + w * p) / (t + w) if t + w > 0 else p for a, t, p in zip(self.accepts, self.trials, self.prior)
            )
        return self._rates


def step_events(outcome: StepOutcome, depths: int, ranks: int) -> list[Event]:
    """The (depth, rank, accepted) trials of one step, clipped to the model's depths x ranks."""
    ev: list[Event] = []
    path = outcome.accepted_ranks
    for d, r in enumerate(path):
        if d >= depths:
            break
        for k in range(min(r, ranks)):
            ev.append((d, k, 0))
        if r < ranks:
            ev.append((d, r, 1))
    d = len(path)
    n = outcome.offered[d] if d < len(outcome.offered) else 0
    if d < depths:
        for k in range(min(n, ranks)):
            ev.append((d, k, 0))
    return ev


class Counts:
    """trials[d][r] and accepts[d][r] as plain lists (tiny; faster than numpy at this size)."""

    __slots__ = ("depths", "ranks", "trials", "accepts")

    def __init__(self, depths: int, ranks: int):
        self.depths, self.ranks = depths, ranks
        self.trials = [[0.0] * ranks for _ in range(depths)]
        self.accepts = [[0.0] * ranks for _ in range(depths)]

    def add(self, events: Iterable[Event], sign: float = 1.0) -> None:
        t, a = self.trials, self.accepts
        for d, r, hit in events:
            t[d][r] += sign
            if hit:
                a[d][r] += sign

    def total_trials(self) -> float:
        return sum(map(sum, self.trials))


class AcceptanceWindow:
    """Counts over the last `size` speculative steps (a deque of per-step events), each step weighted
    by decay**age (decay = 1: a plain sliding window; < 1: recent steps count more, so a drift shows
    sooner)."""

    def __init__(self, size: int, depths: int, ranks: int, decay: float = 1.0):
        self.size = size
        self.decay = decay
        self.counts = Counts(depths, ranks)
        self._steps: deque[list[Event]] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, events: list[Event]) -> None:
        c = self.counts
        if self.decay != 1.0:
            lam = self.decay
            for row in c.trials:
                for r in range(len(row)):
                    row[r] *= lam
            for row in c.accepts:
                for r in range(len(row)):
                    row[r] *= lam
        self._steps.append(events)
        c.add(events)
        if len(self._steps) > self.size:
            c.add(self._steps.popleft(), -(self.decay ** self.size))
            if self.decay != 1.0:  # clamp float drift
                for row in c.trials + c.accepts:
                    for r in range(len(row)):
                        if row[r] < 1e-9:
                            row[r] = 0.0

    def replace_with(self, other: AcceptanceWindow) -> None:
        """Keep only `other`'s steps (e.g. the probe steps, when the breaker closes again)."""
        steps = list(other._steps)[-self.size :]
        self.clear()
        for ev in steps:
            self.add(ev)

    def keep_last(self, n: int) -> None:
        """Forget all but the newest n steps (a detected drift: older steps describe other text)."""
        steps = list(self._steps)[-n:] if n > 0 else []
        self.clear()
        for ev in steps:
            self.add(ev)

    def clear(self) -> None:
        self._steps.clear()
        self.counts = Counts(self.counts.depths, self.counts.ranks)

    @property
    def effective_steps(self) -> float:
        """Sum of the step weights currently in the window."""
        n, lam = len(self._steps), self.decay
        return float(n) if lam == 1.0 else (1 - lam**n) / (1 - lam)


class DropDetector:
    """One-sided Bernoulli CUSUM on the depth-1 top-1 outcome: is the acceptance now `drop` times the
    window's estimate p0? S = max(0, S + log P1(x)/P0(x)); an alarm when S > threshold. It tells how
    many of the newest steps belong to the new regime (those since S last left 0)."""

    def __init__(self, threshold: float, drop: float = 0.5):
        self.threshold, self.drop = threshold, drop
        self.s = 0.0
        self.run = 0  # steps since S was last 0

    def update(self, accepted: bool, p0: float) -> int:
        """Returns the run length at an alarm (and resets), else 0."""
        if self.threshold <= 0:
            return 0
        p0 = min(0.99, max(0.01, p0))
        p1 = p0 * self.drop
        self.s += math.log(p1 / p0) if accepted else math.log((1 - p1) / (1 - p0))
        if self.s <= 0:
            self.s, self.run = 0.0, 0
            return 0
        self.run += 1
        if self.s > self.threshold:
            run = self.run
            self.s, self.run = 0.0, 0
            return run
        return 0

    def reset(self) -> None:
        self.s, self.run = 0.0, 0


def estimate(counts: Counts, prior: list[list[float]], weight: float) -> list[list[float]]:
    """a[d][r] from window counts blended with the prior (see the module docstring)."""
    D, R = counts.depths, counts.ranks
    t, acc = counts.trials, counts.accepts
    level = []
    for r in range(R):
        p1 = prior[0][r]
        den = t[0][r] + weight
        est = (acc[0][r] + weight * p1) / den if den > 0 else p1
        level.append(est / p1 if p1 > 0 else 1.0)
    out = []
    for d in range(D):
        row = []
        pd, td, ad = prior[d], t[d], acc[d]
        for r in range(R):
            base = min(0.995, pd[r] * level[r])
            den = td[r] + weight
            row.append((ad[r] + weight * base) / den if den > 0 else base)
        out.append(row)
    return out


class AcceptancePrior:
    """Per-engine prior a[d][r], learnt across requests: after each request, an EWMA towards the
    request's own acceptance rates, weighted by how much evidence the request had (full weight
    `alpha` at >= `full_trials` trials of that (depth, rank))."""

    def __init__(self, depths: int = 16, ranks: int = 8, alpha: float = 0.2, full_trials: float = 8.0,
                 rank_acceptance: Iterable[float] = DEFAULT_RANK_ACCEPTANCE):
        ra = list(rank_acceptance)[:ranks]
        ra += [ra[-1]] * (ranks - len(ra))
        self.depths, self.ranks = depths, ranks
        self.alpha, self.full_trials = alpha, full_trials
        self.rates = [list(ra) for _ in range(depths)]
        self.requests = 0
        self.spec_bias = 1.0  # realized / predicted seconds of speculative steps, across requests
        # confidence calibration before evidence: the bucket's centre (the draft's p taken at its word)
        self.calib = [(b + 0.5) / CALIB_BUCKETS for b in range(CALIB_BUCKETS)]
        self.cooldown_scale = 1.0  # first cooldown of a request, in units of cooldown_tokens

    def view(self, depths: int, ranks: int) -> list[list[float]]:
        """The prior cut (or padded with its last row/column) to depths x ranks."""
        out = []
        for d in range(depths):
            row = self.rates[min(d, self.depths - 1)]
            out.append([row[min(r, self.ranks - 1)] for r in range(ranks)])
        return out

    def update_from(self, ev: RequestEvidence) -> None:
        self.update_from_counts(ev.counts)
        self.update_calibration(ev.calibration)
        # probes that keep failing on this machine: later requests wait longer before probing
        probes = ev.probe_results
        if "closed" in probes:
            self.cooldown_scale = 1.0
        elif probes:
            self.cooldown_scale = min(ev.max_cooldown_tokens / ev.cooldown_tokens,
                                      self.cooldown_scale * ev.cooldown_growth ** len(probes))
        # the step-time model's measured bias is a property of the machine: carry it over
        if ev.bias_steps > 0:
            w = self.alpha * min(1.0, ev.bias_steps / self.full_trials)
            self.spec_bias += w * (ev.spec_bias - self.spec_bias)

    def update_from_counts(self, counts: Counts) -> None:
        if counts.total_trials() <= 0:
            return
        for d in range(min(self.depths, counts.depths)):
            for r in range(min(self.ranks, counts.ranks)):
                self.rates[d][r] = self._toward(self.rates[d][r], counts.accepts[d][r], counts.trials[d][r])
        self.requests += 1

    def update_calibration(self, cal: Calibration) -> None:
        for b in range(CALIB_BUCKETS):
            self.calib[b] = self._toward(self.calib[b], cal.accepts[b], cal.trials[b])

    def _toward(self, old: float, accepts: float, trials: float) -> float:
        """The EWMA step of a prior rate towards a request's accepts / trials, weighted by its
        evidence (full weight `alpha` at `full_trials`); unchanged without trials."""
        if trials <= 0:
            return old
        w = self.alpha * min(1.0, trials / self.full_trials)
        # keep the prior away from 0/1 so a request can always move it back
        return min(0.99, max(0.01, (1 - w) * old + w * accepts / trials))

    def as_dict(self) -> dict:
        return {
            "requests": self.requests,
            "calibration": [round(x, 4) for x in self.calib],
            "top1_by_depth": [round(row[0], 4) for row in self.rates],
            "by_rank_depth1": [round(x, 4) for x in self.rates[0]],
        }
