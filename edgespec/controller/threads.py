"""The thread governor: how many CPU threads the target's forwards use, the configured count or
one, whichever the host serves faster right now.

ggml's CPU threads meet at a spinning barrier after every graph node. On a host where another
process holds a core (an appliance's neighbours: backups, log shippers, a second model), one of
two threads is descheduled for a scheduler time slice at a time while the other spins, and a
forward of a few hundred nodes takes many times its calibrated time; one thread then runs at a
steady half speed and wins. Each timed forward gives the ratio measured / calibrated seconds
(calibrated at the configured count); the governor keeps the last few ratios per choice, runs
the choice with the lower median, and probes the other now and then (at once when the current
choice runs slower than one thread would on a quiet host). The reduction order of every output
element is the same at any thread count (tools/patches/), so the choice changes time only."""

from __future__ import annotations

from collections import deque


def _median(xs) -> float:
    v = sorted(xs)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


class ThreadGovernor:
    WINDOW = 9  # ratios kept per choice
    MIN_OBS = 3
    PROBE_TICKS = 4  # forwards a probe runs the other choice
    PROBE_EVERY = 256  # forwards between probes of the other choice while the current one is fine
    SLOW = 2.2  # a ratio above this: slower than one thread on a quiet host (~1.8-2x): probe soon
    SLOW_PROBE_EVERY = 24

    def __init__(self, threads: int, enabled: bool = True):
        self.configured = threads
        self.options = (threads, 1) if threads > 1 and enabled else (threads,)
        self.ratios: dict[int, deque[float]] = {n: deque(maxlen=self.WINDOW) for n in self.options}
        self.current = threads
        self.ticks = 0
        self.last = {n: 0 for n in self.options}  # tick of each choice's last forward
        self._probe: tuple[int, int] | None = None  # (choice, forwards left)
        self.switches = 0

    def _score(self, n: int) -> float | None:
        r = self.ratios[n]
        return _median(r) if len(r) >= self.MIN_OBS else None

    def choose(self) -> int:
        """The thread count for the next forward."""
        self.ticks += 1
        if len(self.options) == 1:
            return self.current
        if self._probe is not None:
            n, left = self._probe
            self._probe = (n, left - 1) if left > 1 else None
            return n
        scores = {n: self._score(n) for n in self.options}
        known = {n: s for n, s in scores.items() if s is not None}
        best = min(known, key=lambda n: known[n]) if known else self.configured
        if best != self.current:
            self.switches += 1
            self.current = best
        other = next(n for n in self.options if n != self.current)
        cur = scores[self.current]
        wait = self.SLOW_PROBE_EVERY if cur is not None and cur > self.SLOW else self.PROBE_EVERY
        if self.ticks - self.last[other] >= wait and cur is not None:
            self.ratios[other].clear()  # fresh evidence: the host may have changed
            self._probe = (other, self.PROBE_TICKS - 1) if self.PROBE_TICKS > 1 else None
            return other
        return self.current

    def record(self, threads: int, seconds: float, calibrated_seconds: float) -> None:
        """One timed target forward at `threads` threads; `calibrated_seconds`: the start-up
        calibration's time for a forward of that size (at the configured count)."""
        if threads not in self.ratios or not seconds > 0 or not calibrated_seconds > 0:
            return
        self.ratios[threads].append(seconds / calibrated_seconds)
        self.last[threads] = self.ticks

    def as_dict(self) -> dict:
        return {"threads_current": self.current, "threads_switches": self.switches,
                **{f"threads_{n}_ratio": round(s, 3) for n in self.options if (s := self._score(n)) is not None}}
