"""GoodputGuard: auto is never slower than plain decoding, measured, not predicted.

The controller's choices rest on models (acceptance, cost curves, the measured model bias);
the guard checks the outcome. Per load level -- the number of sessions decoding in the tick and
the host's speed (the cost model's host factor, in factor-of-2 steps) -- it keeps the realised
tokens per second of the last `window` ticks that speculated with a drafter and of the last
`window` that decoded plainly (ratio of sums: tokens emitted / tick wall seconds, prefill-free
ticks only). When both hold `min_ticks` ticks and speculation's rate is below plain's by more
than `margin`, the level falls back to plain: the schedule turns every auto session's shape
plain there (prompt lookups still graft: they cost no draft forward). A fallen-back level
re-probes: after `reprobe` plain ticks, `probe` ticks speculate again; a probe that still loses
doubles the wait (up to `max_reprobe`), one that wins clears the fallback. While a level
speculates it needs fresh plain ticks to compare with: when its plain window is short or older
than `stale` ticks, one tick in `explore` is decoded plainly.

One per engine, engine thread only. Pure Python.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

Key = tuple[int, int]  # (sessions decoding, load level)


@dataclass
class _Level:
    spec: deque = field(default_factory=deque)  # (tokens, seconds) of speculating ticks
    plain: deque = field(default_factory=deque)  # (tokens, seconds) of plain ticks
    plain_at: int = -(1 << 30)  # tick count of the last plain tick
    fallback: bool = False
    wait: int = 0  # plain ticks until the next probe (fallback)
    backoff: int = 0  # the current wait between probes
    probe_left: int = 0  # speculating ticks left in the current probe
    since_plain: int = 0  # speculating ticks since the last plain one (exploration)
    blocked: int = 0  # ticks the guard turned plain
    fallbacks: int = 0  # times the level fell back


def _rate(w: deque) -> float:
    s = sum(sec for _, sec in w)
    return sum(t for t, _ in w) / s if s > 0 else 0.0


class GoodputGuard:
    def __init__(self, margin: float = 0.03, window: int = 16, min_ticks: int = 4, reprobe: int = 64,
                 max_reprobe: int = 1024, probe: int = 4, explore: int = 32, stale: int = 512,
                 enabled: bool = True):
        self.enabled = enabled  # False: allow() always, nothing recorded (tests on wall-clock-free fakes)
        self.margin, self.window, self.min_ticks = margin, window, min_ticks
        self.reprobe, self.max_reprobe, self.probe = reprobe, max_reprobe, probe
        self.explore, self.stale = explore, stale
        self.levels: dict[Key, _Level] = {}
        self.ticks = 0

    @staticmethod
    def key(decoding: int, host_factor: float) -> Key:
        # factor-of-2 steps: finer ones split a busy host's evidence over many levels (its host
        # factor swings from tick to tick)
        load = int(round(math.log2(max(1e-3, host_factor))))
        return (decoding, max(-2, min(5, load)))

    def _level(self, key: Key) -> _Level:
        lv = self.levels.get(key)
        if lv is None:
            lv = self.levels[key] = _Level(deque(maxlen=self.window), deque(maxlen=self.window))
        return lv

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
        fresh = len(lv.plain) >= self.min_ticks and self.ticks - lv.plain_at < self.stale
        if not fresh and lv.since_plain >= self.explore:
            lv.blocked += 1
            return False
        return True

    def record(self, key: Key, speculated: bool, tokens: int, seconds: float) -> None:
        """One prefill-free tick at `key`: whether a drafter ran, tokens emitted, wall seconds."""
        self.ticks += 1
        if not self.enabled or tokens <= 0 or not seconds > 0:
            return
        lv = self._level(key)
        if not speculated:
            lv.plain.append((tokens, seconds))
            lv.plain_at = self.ticks
            lv.since_plain = 0
            return
        lv.spec.append((tokens, seconds))
        lv.since_plain += 1
        if lv.fallback and lv.probe_left > 0:
            lv.probe_left -= 1
            if lv.probe_left == 0:
                if self._loses(lv) is False:
                    lv.fallback = False
                else:
                    lv.backoff = lv.wait = min(self.max_reprobe, 2 * lv.backoff)
            return
        if not lv.fallback and self._loses(lv):
            lv.fallback = True
            lv.fallbacks += 1
            lv.backoff = lv.wait = self.reprobe

    def _loses(self, lv: _Level) -> bool | None:
        """Speculation's realised rate below plain's by more than the margin (None: too few ticks)."""
        if len(lv.spec) < min(self.min_ticks, self.probe) or len(lv.plain) < self.min_ticks:
            return None
        return _rate(lv.spec) < (1.0 - self.margin) * _rate(lv.plain)

    # -- reporting --------------------------------------------------------------------------------
    def flat(self) -> dict[str, float]:
        """For Admin.Stats' tick_totals: levels falling back now, ticks turned plain, and per
        level (goodput_<sessions>_<load>_...) both rates and the fallback flag."""
        out: dict[str, float] = {
            "goodput_fallback_levels": float(sum(lv.fallback for lv in self.levels.values())),
            "goodput_blocked_ticks": float(sum(lv.blocked for lv in self.levels.values())),
            "goodput_fallbacks": float(sum(lv.fallbacks for lv in self.levels.values())),
        }
        for (n, load), lv in sorted(self.levels.items()):
            p = f"goodput_{n}_{load}_"
            out[p + "spec_tokens_per_second"] = _rate(lv.spec)
            out[p + "plain_tokens_per_second"] = _rate(lv.plain)
            out[p + "fallback"] = float(lv.fallback)
        return out
