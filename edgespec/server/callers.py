"""Per-caller limits and figures, shared by gRPC and HTTP: how many requests one caller (its
identity: `token:NAME`, `cert:SUBJECT`, `anonymous`) may have running or queued at once, and how
many tokens (prompt + completion) it may use in any 60 seconds. A caller over its limit is
refused at once (CallerLimited: 429 with Retry-After / RESOURCE_EXHAUSTED with
grpc-retry-pushback-ms) and nobody else's requests are touched: the limits are checked before a
job reaches the engine's queue.

Figures per caller (requests, refusals, tokens, in flight) are kept for the identities named in
`[limits] callers` and for `other` (everyone else together), so the metrics' label set is bounded
by the configuration, not by who calls."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from edgespec.errors import Overloaded

WINDOW_SECONDS = 60.0
OTHER = "other"


class CallerLimited(Overloaded):
    """One caller is over its own limit (other callers are unaffected)."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = max(0.001, retry_after)


@dataclass(frozen=True)
class Caps:
    concurrent: int = 0  # 0 = no cap
    tokens_per_minute: int = 0


def parse_callers(entries: tuple[str, ...] | list[str]) -> dict[str, Caps]:
    """[limits] callers: "IDENTITY=CONCURRENT/TOKENS_PER_MINUTE" (checked by the settings)."""
    out = {}
    for e in entries:
        who, _, caps = e.rpartition("=")
        c, t = caps.split("/")
        out[who.strip()] = Caps(int(c), int(t))
    return out


@dataclass
class Figures:
    requests: int = 0
    rejected: int = 0
    tokens: int = 0
    in_flight: int = 0


class CallerLimits:
    def __init__(self, limits: object, clock: Callable[[], float] = time.monotonic):
        self.default = Caps(getattr(limits, "caller_concurrent", 0), getattr(limits, "caller_tokens_per_minute", 0))
        self.named = parse_callers(getattr(limits, "callers", ()))
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._used: dict[str, deque[tuple[float, int]]] = {}  # identity -> (time, tokens) in the window
        self.figures: dict[str, Figures] = {k: Figures() for k in (*self.named, OTHER)}

    def caps(self, identity: str) -> Caps:
        return self.named.get(identity, self.default)

    def _fig(self, identity: str) -> Figures:
        return self.figures[identity if identity in self.named else OTHER]

    def _window(self, identity: str, now: float) -> deque[tuple[float, int]]:
        used = self._used.setdefault(identity, deque())
        while used and used[0][0] <= now - WINDOW_SECONDS:
            used.popleft()
        return used

    @contextmanager
    def admit(self, identity: str) -> Iterator[Callable[[int], None]]:
        """Hold one of the caller's concurrent places for a request; raises CallerLimited when it
        has none left or its token window is full. Yields `used(tokens)`, to count the
        request's tokens when it ends."""
        identity = identity or "anonymous"
        caps = self.caps(identity)
        now = self._clock()
        with self._lock:
            fig = self._fig(identity)
            held = self._in_flight.get(identity, 0)
            if caps.concurrent and held >= caps.concurrent:
                fig.rejected += 1
                raise CallerLimited(f"{identity} has {held} requests in flight, its limit "
                                    f"(limits.caller_concurrent / limits.callers)", 1.0)
            if caps.tokens_per_minute:
                used = self._window(identity, now)
                total = sum(n for _, n in used)
                if total >= caps.tokens_per_minute:
                    fig.rejected += 1
                    wait = used[0][0] + WINDOW_SECONDS - now if used else 1.0
                    raise CallerLimited(f"{identity} used {total} tokens in the last minute, its limit "
                                        f"(limits.caller_tokens_per_minute / limits.callers)", wait)
            self._in_flight[identity] = held + 1
            fig.requests += 1
            fig.in_flight += 1

        def used(tokens: int) -> None:
            with self._lock:
                self._window(identity, self._clock()).append((self._clock(), int(tokens)))
                self._fig(identity).tokens += int(tokens)

        try:
            yield used
        finally:
            with self._lock:
                self._in_flight[identity] -= 1
                if not self._in_flight[identity]:
                    del self._in_flight[identity]
                self._fig(identity).in_flight -= 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {k: vars(f).copy() for k, f in self.figures.items()}


def retry_after_seconds(exc: BaseException) -> int | None:
    """Whole seconds for a Retry-After header (at least 1), or None."""
    ra = getattr(exc, "retry_after", None)
    return None if ra is None else max(1, math.ceil(ra))


def current_caller() -> str:
    """The identity the auth layer bound for this request (gRPC and HTTP bind `caller`)."""
    import structlog

    return str(structlog.contextvars.get_contextvars().get("caller") or "anonymous")
