"""GoodputGuard: auto is never slower than plain decoding, measured, not predicted.

The controller's choices rest on models (acceptance, cost curves, the measured model bias);
the guard checks the outcome. It judges each tick's realised goodput in *plain-token units*:
the tick's emitted tokens times the seconds a plain token costs at that many sessions by the
online cost model (`unit`: the predicted plain forward of the tick's sessions over their
number), over the tick's wall seconds. A plain tick scores about 1 whatever the number of
sessions and however fast the host is this minute (the online curves follow it); a speculating
tick scores above 1 when it pays. So plain evidence from any number of sessions can judge
speculation at any other, and a level needs only its own speculating ticks.

Levels are (sessions decoding, rounded up to a power of two; the host's load, the cost model's
host factor in factor-of-2 steps). Per level the guard keeps the last `window` speculating
ticks and the last `window` plain ones; plain's reference is the level's own plain window when
it holds `min_ticks` recent ticks, else the pooled plain window of every level at that load.
Prefill-free ticks only. When speculation's score is below plain's by more than `margin`, and by
more than `z` standard errors of the two windows' scores (speculating ticks emit 1 to 17 tokens,
so one window of them scatters widely: without the evidence test a level that wins on average
fell back on an unlucky run of ticks, several times a minute), the level falls back to plain: the schedule turns every auto session's shape plain there, bare (no
prompt-lookup or suffix-cache grafts: their tokens cost verification, so a tick that grafts
them counts as speculating). A fallen-back level re-probes: after
`reprobe` plain ticks, `probe` ticks speculate again; a probe that still loses doubles the wait
(up to `max_reprobe`), one that wins clears the fallback. While a level speculates it needs
fresh plain ticks to compare with: when no plain reference is recent (`stale` ticks), one tick
in `explore` is decoded plainly, and one in `explore_first` until the load's first `min_ticks`
plain ticks are in (a fresh process). A tick whose drafter first catches up on more than
`max_catchup` tokens (a request's prompt, or what was decoded while the level was held plain)
is not scored (tick/observe.py): it pays a one-off debt, not the rate speculation runs at, and a
probe scored on it lost for the fallback's own sake. A request that starts decoding alone probes
a fallen-back level at once (`new_request`).

One per engine, engine thread only. Pure Python.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

Key = tuple[int, int]  # (sessions decoding, as a power of two; load level)


@dataclass
class _Level:
    spec: deque = field(default_factory=deque)  # (plain-token units, seconds) of speculating ticks
    plain: deque = field(default_factory=deque)  # (plain-token units, seconds) of plain ticks
    plain_at: int = -(1 << 30)  # tick count of the last plain tick
    fallback: bool = False
    wait: int = 0  # plain ticks until the next probe (fallback)
    backoff: int = 0  # the current wait between probes
    probe_left: int = 0  # speculating ticks left in the current probe
    since_plain: int = 0  # speculating ticks since the last plain one (exploration)
    blocked: int = 0  # ticks the guard turned plain
    fallbacks: int = 0  # times the level fell back


@dataclass
class _Pool:
    plain: deque = field(default_factory=deque)  # every level's plain ticks at one load
    plain_at: int = -(1 << 30)


def _rate(w: deque) -> float:
    s = sum(sec for _, sec in w)
    return sum(t for t, _ in w) / s if s > 0 else 0.0


def _se(w: deque) -> float:
    """Standard error of `_rate(w)`, a ratio estimator (sum of units / sum of seconds): the
    ticks' residuals from the pooled rate, weighted by their seconds."""
    n = len(w)
    s = sum(sec for _, sec in w)
    if n < 2 or s <= 0:
        return 0.0
    r = sum(t for t, _ in w) / s
    return math.sqrt(sum((t - r * sec) ** 2 for t, sec in w) * n / (n - 1)) / s


class GoodputGuard:
    def __init__(self, margin: float = 0.03, window: int = 32, min_ticks: int = 4, reprobe: int = 64,
                 max_reprobe: int = 1024, probe: int = 4, explore: int = 32, explore_first: int = 4,
                 stale: int = 512, max_catchup: int = 32, z: float = 1.0, probe_new: bool = True,
                 enabled: bool = True):
        self.enabled = enabled  # False: allow() always, nothing recorded (tests on wall-clock-free fakes)
        self.probe_new = probe_new  # a request that starts alone probes a fallen-back level at once
        self.z = z  # standard errors the shortfall must exceed (0: the margin alone decides)
        self.max_catchup = max_catchup  # longer draft catch-ups: the tick is not scored
        self.margin, self.window, self.min_ticks = margin, window, min_ticks
        self.reprobe, self.max_reprobe, self.probe = reprobe, max_reprobe, probe
        self.explore, self.explore_first, self.stale = explore, explore_first, stale
        self.levels: dict[Key, _Level] = {}
        self.pools: dict[int, _Pool] = {}
        self.ticks = 0

    @staticmethod
    def key(decoding: int, host_factor: float) -> Key:
        # sessions in power-of-two buckets and the load in factor-of-2 steps: finer ones split the
        # evidence over many levels (at 8 streams the decoding count moves from tick to tick as
        # requests end and prompts prefill; a busy host's factor swings)
        sessions = 1 << max(0, math.ceil(math.log2(max(1, decoding))))
        load = int(round(math.log2(max(1e-3, host_factor))))
        return (sessions, max(-2, min(5, load)))

    def _level(self, key: Key) -> _Level:
        lv = self.levels.get(key)
        if lv is None:
            lv = self.levels[key] = _Level(deque(maxlen=self.window), deque(maxlen=self.window))
        return lv

    def _pool(self, key: Key) -> _Pool:
        pool = self.pools.get(key[1])
        if pool is None:
            pool = self.pools[key[1]] = _Pool(deque(maxlen=2 * self.window))
        return pool

    def _plain_ref(self, key: Key, lv: _Level) -> deque | None:
        """Plain's recent ticks to judge this level by: its own, else its load's pool."""
        if len(lv.plain) >= self.min_ticks and self.ticks - lv.plain_at < self.stale:
            return lv.plain
        pool = self.pools.get(key[1])  # none yet: no plain ticks at this load
        if pool is not None and len(pool.plain) >= self.min_ticks and self.ticks - pool.plain_at < self.stale:
            return pool.plain
        return None

    def allow(self, key: Key) -> bool:
        """May this tick speculate at `key`? (False: decode every auto session plainly.)"""
        if not self.enabled:
            return True
        lv = self._level(key)
        if lv.fallback:
            if lv.probe_left > 0:
                return True
            if lv.wait <= 0:
                lv.probe_left = self.probe
                lv.spec.clear()  # judge the probe on its own ticks
                return True
            lv.wait -= 1
            lv.blocked += 1
            return False
        if self._plain_ref(key, lv) is None:
            first = len(self._pool(key).plain) < self.min_ticks
            if lv.since_plain >= (self.explore_first if first else self.explore):
                lv.blocked += 1
                return False
        return True

    def allows(self, key: Key, new_request: bool = False) -> bool:
        """What `allow(key)` will answer (after `new_request(key)` when `new_request`), changing
        nothing: the schedule asks this, the tick's start then asks `allow`."""
        if not self.enabled:
            return True
        lv = self.levels.get(key) or _Level()  # `allow` makes a level it has not seen, as this one
        if lv.fallback:
            if lv.probe_left > 0:
                return True
            return (0 if new_request and self.probe_new else lv.wait) <= 0
        if self._plain_ref(key, lv) is None:
            pool = self.pools.get(key[1])
            first = pool is None or len(pool.plain) < self.min_ticks
            return lv.since_plain < (self.explore_first if first else self.explore)
        return True

    def holds(self, key: Key) -> bool:
        """Whether the level has fallen back and is not probing: what a step that cannot ask
        `allow` (a request's first step, riding its prompt's forward) follows, leaving the
        level's wait and probes to the ticks it judges."""
        lv = self.levels.get(key)
        return self.enabled and lv is not None and lv.fallback and lv.probe_left <= 0

    def new_request(self, key: Key) -> None:
        """A request starts decoding alone at `key`. At one stream the level's evidence is the
        previous request's text (a draft that failed on one request's Chinese says little about
        the next one's JSON), so a fallen-back level probes this request at once; the backoff is
        kept, so a probe that loses still doubles the next wait."""
        lv = self.levels.get(key)
        if self.enabled and self.probe_new and lv is not None and lv.fallback and lv.probe_left == 0:
            lv.wait = 0

    def record(self, key: Key, speculated: bool, tokens: int, seconds: float, unit: float = 1.0) -> None:
        """One prefill-free tick at `key`: whether it speculated (a drafter ran, or lookups or the
        suffix cache grafted), tokens emitted, wall seconds, and the cost model's seconds per
        plain token at this many sessions (1.0: score raw tokens/s)."""
        self.ticks += 1
        if not self.enabled or tokens <= 0 or not seconds > 0 or not unit > 0:
            return
        lv = self._level(key)
        sample = (tokens * unit, seconds)
        if not speculated:
            lv.plain.append(sample)
            lv.plain_at = self.ticks
            lv.since_plain = 0
            pool = self._pool(key)
            pool.plain.append(sample)
            pool.plain_at = self.ticks
            return
        lv.spec.append(sample)
        lv.since_plain += 1
        if lv.fallback and lv.probe_left > 0:
            lv.probe_left -= 1
            if lv.probe_left == 0:
                if self._loses(key, lv) is False:
                    lv.fallback = False
                else:
                    lv.backoff = lv.wait = min(self.max_reprobe, 2 * lv.backoff)
            return
        if not lv.fallback and self._loses(key, lv):
            lv.fallback = True
            lv.fallbacks += 1
            lv.backoff = lv.wait = self.reprobe

    def _loses(self, key: Key, lv: _Level) -> bool | None:
        """Speculation's realised score below plain's by more than the margin and by more than `z`
        standard errors (None: too few ticks)."""
        ref = self._plain_ref(key, lv)
        if len(lv.spec) < min(self.min_ticks, self.probe) or ref is None:
            return None
        shortfall = (1.0 - self.margin) * _rate(ref) - _rate(lv.spec)
        return shortfall > 0 and shortfall > self.z * math.hypot(_se(lv.spec), _se(ref))

    # -- reporting --------------------------------------------------------------------------------
    def flat(self) -> dict[str, float]:
        """For Admin.Stats' tick_totals: levels falling back now, ticks turned plain, and per
        level (goodput_<sessions>_<load>_...) both scores (plain-token units per second: 1 is
        the cost model's plain rate) and the fallback flag."""
        out: dict[str, float] = {
            "goodput_fallback_levels": float(sum(lv.fallback for lv in self.levels.values())),
            "goodput_blocked_ticks": float(sum(lv.blocked for lv in self.levels.values())),
            "goodput_fallbacks": float(sum(lv.fallbacks for lv in self.levels.values())),
        }
        for (n, load), lv in sorted(self.levels.items()):
            p = f"goodput_{n}_{load}_"
            out[p + "spec_score"] = _rate(lv.spec)
            out[p + "plain_score"] = _rate(lv.plain)
            out[p + "fallback"] = float(lv.fallback)
        return out
