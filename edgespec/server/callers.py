"""Per-caller limits and figures, shared by gRPC and HTTP: how many requests one caller (its
identity: `token:NAME`, `cert:SUBJECT`, `anonymous`) may have running in engine slots, how many
more may wait for a slot, and how many tokens (prompt + completion) it may use in any 60 seconds.
A caller over its limit is refused at once (CallerLimited: 429 with Retry-After /
RESOURCE_EXHAUSTED with grpc-retry-pushback-ms) and nobody else's requests are touched: the
queued and token limits are checked before a job reaches the engine's queue, and the engine
loop starts a queued job only while its caller is under its concurrent limit (`Place.start`), so
another caller's job goes past one that waits for its own caller's slot.

Each admitted request holds one `Place`: queued -> running -> released, each step at most once,
so the counts cannot leak whatever ends the request (a result, a cancel, a deadline, an error
before or after submission). The engine thread moves a place to running as it gives the job a
slot and releases it when the job leaves the slot (so `running` is what the slots hold, a
cancelled request's too until the engine has ended it); the handler releases the place when the
engine never started it (`Place.close`).

Figures per caller (requests, refusals by reason, tokens, running, queued) are kept for the
identities named in `[limits] callers` and for `other` (everyone else together), so the metrics'
label set is bounded by the configuration, not by who calls."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from edgespec.errors import Overloaded

WINDOW_SECONDS = 60.0
OTHER = "other"
REASONS = ("concurrent", "queued", "tokens")  # why a caller's request was refused
RETRY_SECONDS = 1.0  # Retry-After for a caller whose places are full (a slot frees within ticks)


class CallerLimited(Overloaded):
    """One caller is over its own limit (other callers are unaffected)."""

    def __init__(self, message: str, retry_after: float, reason: str = "concurrent"):
        super().__init__(message)
        self.retry_after = max(0.001, retry_after)
        self.reason = reason


@dataclass(frozen=True)
class Caps:
    concurrent: int = 0  # running in engine slots; 0 = no cap
    tokens_per_minute: int = 0
    queued: int = 0  # waiting for a slot beyond the running ones; 0 = no cap (the server's queue_size bounds)


def parse_caps(caps: str, queued: int = 0) -> Caps:
    """"CONCURRENT/QUEUED/TOKENS_PER_MINUTE", or "CONCURRENT/TOKENS_PER_MINUTE" with `queued` (the
    default's); ValueError otherwise."""
    parts = [p.strip() for p in caps.split("/")]
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
        raise ValueError(caps)
    if len(parts) == 2:
        return Caps(concurrent=int(parts[0]), tokens_per_minute=int(parts[1]), queued=queued)
    return Caps(concurrent=int(parts[0]), queued=int(parts[1]), tokens_per_minute=int(parts[2]))


def parse_callers(entries: tuple[str, ...] | list[str], queued: int = 0) -> dict[str, Caps]:
    """[limits] callers: "IDENTITY=CONCURRENT[/QUEUED]/TOKENS_PER_MINUTE" (checked by the settings);
    `queued` for the entries without one."""
    out = {}
    for e in entries:
        who, _, caps = e.rpartition("=")
        out[who.strip()] = parse_caps(caps, queued)
    return out


@dataclass
class Figures:
    requests: int = 0
    rejected: int = 0  # all reasons together
    tokens: int = 0
    running: int = 0
    queued: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))

    @property
    def in_flight(self) -> int:
        return self.running + self.queued


@dataclass
class _Counts:  # one identity's places now
    running: int = 0
    queued: int = 0


class Place:
    """One admitted request's place under its caller's limits: queued -> running -> released.
    Thread-safe; `release` may be called any number of times, from any state."""

    def __init__(self, limits: CallerLimits, identity: str, state: str):
        self._limits, self.identity, self.state = limits, identity, state
        self.engine_held = False  # started by the engine loop: it releases the place, not the handler
        self.reserved = 0  # tokens this request may still use (prompt + max_tokens), until released

    def reserve(self, tokens: int) -> None:
        """The most tokens the request may use: counted against its caller's tokens-per-minute
        limit while it is in flight, so that concurrent requests cannot overshoot it together.
        CallerLimited (the place then still to be closed) when the caller's other requests
        reserved the limit since this one was admitted."""
        self._limits._reserve(self, tokens)

    def start(self) -> bool:
        """Queued -> running if the caller is under its concurrent limit (the engine thread, as
        it gives the job a slot). True when running; False while it must wait, or once released."""
        return self._limits._start(self)

    def release(self) -> None:
        """The request left its slot or the queue (the engine loop, as the job finishes)."""
        self._limits._release(self)

    def close(self) -> None:
        """The handler is done with the request: release the place unless the engine holds it
        (a started job is released by the engine as it leaves its slot)."""
        self._limits._release(self, unless_engine_held=True)

    def used(self, tokens: int) -> None:
        """Count the request's tokens (prompt + completion) in the caller's window."""
        self._limits._count_tokens(self.identity, tokens)


class CallerLimits:
    def __init__(self, limits: object, clock: Callable[[], float] = time.monotonic):
        self.default = Caps(concurrent=getattr(limits, "caller_concurrent", 0),
                            tokens_per_minute=getattr(limits, "caller_tokens_per_minute", 0),
                            queued=getattr(limits, "caller_queued", 0))
        self.named = parse_callers(getattr(limits, "callers", ()), self.default.queued)
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: dict[str, _Counts] = {}  # identities with places now (none left: removed)
        self._used: dict[str, deque[tuple[float, int]]] = {}  # identity -> (time, tokens) in the window
        self._reserved: dict[str, int] = {}  # identity -> tokens its requests in flight may still use
        self.figures: dict[str, Figures] = {k: Figures() for k in (*self.named, OTHER)}

    def caps(self, identity: str) -> Caps:
        return self.named.get(identity, self.default)

    def _fig(self, identity: str) -> Figures:
        return self.figures[identity if identity in self.named else OTHER]

    def _window(self, identity: str, now: float) -> deque[tuple[float, int]]:
        used = self._used.setdefault(identity, deque())
        while used and used[0][0] <= now - WINDOW_SECONDS:
            used.popleft()
        if not used:
            del self._used[identity]  # no state kept for a caller with nothing in its window
            return deque()
        return used

    def _refuse(self, fig: Figures, reason: str, message: str, retry_after: float) -> CallerLimited:
        fig.rejected += 1
        fig.rejected_by_reason[reason] += 1
        return CallerLimited(message, retry_after, reason)

    def place(self, identity: str, *, queued: bool = True) -> Place:
        """A place for one request, or CallerLimited. `queued`: the request waits for an engine
        slot (a generation; the engine loop starts it); False: it runs at once (an embedding)."""
        identity = identity or "anonymous"
        caps = self.caps(identity)
        now = self._clock()
        with self._lock:
            fig = self._fig(identity)
            n = self._counts.get(identity) or _Counts()
            if queued and caps.queued:
                # the requests beyond the caller's free running places are the ones that wait
                room = max(0, caps.concurrent - n.running) if caps.concurrent else 0
                if n.queued >= caps.queued + room:
                    raise self._refuse(fig, "queued", f"{identity} has {n.running} requests running and "
                                       f"{n.queued} queued, its limit (limits.caller_queued / limits.callers)",
                                       RETRY_SECONDS)
            if not queued and caps.concurrent and n.running >= caps.concurrent:
                raise self._refuse(fig, "concurrent", f"{identity} has {n.running} requests running, its limit "
                                   f"(limits.caller_concurrent / limits.callers)", RETRY_SECONDS)
            self._within_tokens(identity, caps, fig, now)
            self._counts[identity] = n
            fig.requests += 1
            if queued:
                n.queued += 1
                fig.queued += 1
            else:
                n.running += 1
                fig.running += 1
        return Place(self, identity, "queued" if queued else "running")

    @contextmanager
    def admit(self, identity: str, *, queued: bool = True) -> Iterator[Place]:
        """`place()` held for a block, closed as it ends (`Place.close`)."""
        p = self.place(identity, queued=queued)
        try:
            yield p
        finally:
            p.close()

    def _start(self, p: Place) -> bool:
        with self._lock:
            if p.state != "queued":
                return p.state == "running"
            n, cap = self._counts[p.identity], self.caps(p.identity).concurrent
            if cap and n.running >= cap:
                return False
            fig = self._fig(p.identity)
            n.queued -= 1
            fig.queued -= 1
            n.running += 1
            fig.running += 1
            p.state = "running"
            p.engine_held = True
            return True

    def _release(self, p: Place, unless_engine_held: bool = False) -> None:
        with self._lock:
            if p.state == "released" or (unless_engine_held and p.engine_held):
                return
            n, fig = self._counts[p.identity], self._fig(p.identity)
            if p.state == "queued":
                n.queued -= 1
                fig.queued -= 1
            else:
                n.running -= 1
                fig.running -= 1
            p.state = "released"
            self._unreserve(p)
            if not n.running and not n.queued:
                del self._counts[p.identity]

    def _within_tokens(self, identity: str, caps: Caps, fig: Figures, now: float) -> None:
        """CallerLimited unless what the window holds and what the caller's requests in flight may
        still use are under its tokens-per-minute limit (under the lock)."""
        if not caps.tokens_per_minute:
            return
        used = self._window(identity, now)
        total = sum(t for _, t in used) + self._reserved.get(identity, 0)
        if total >= caps.tokens_per_minute:
            wait = used[0][0] + WINDOW_SECONDS - now if used else RETRY_SECONDS
            raise self._refuse(fig, "tokens", f"{identity} used or holds in flight {total} tokens of the "
                               f"last minute, its limit (limits.caller_tokens_per_minute / limits.callers)", wait)

    def _reserve(self, p: Place, tokens: int) -> None:
        with self._lock:
            if p.state == "released":
                return
            if not p.reserved:
                # checked again as the request's tokens are known: requests admitted together
                # (their prompts tokenised and constraints compiled in parallel after admission)
                # reserve one at a time, and those past the limit are refused here
                self._within_tokens(p.identity, self.caps(p.identity), self._fig(p.identity), self._clock())
            self._unreserve(p)
            p.reserved = max(0, int(tokens))
            if p.reserved:
                self._reserved[p.identity] = self._reserved.get(p.identity, 0) + p.reserved

    def _unreserve(self, p: Place) -> None:  # under the lock
        if p.reserved:
            left = self._reserved.get(p.identity, 0) - p.reserved
            if left > 0:
                self._reserved[p.identity] = left
            else:
                self._reserved.pop(p.identity, None)
            p.reserved = 0

    def _count_tokens(self, identity: str, tokens: int) -> None:
        with self._lock:
            now = self._clock()
            self._used.setdefault(identity, deque()).append((now, int(tokens)))
            self._fig(identity).tokens += int(tokens)

    def counts(self, identity: str) -> tuple[int, int]:
        """(running, queued) of one identity now."""
        with self._lock:
            n = self._counts.get(identity) or _Counts()
            return n.running, n.queued

    def snapshot(self) -> dict[str, dict]:
        """Per label: requests, rejected, rejected_by_reason, tokens, running, queued, in_flight."""
        with self._lock:
            return {k: {"requests": f.requests, "rejected": f.rejected, "tokens": f.tokens, "running": f.running,
                        "queued": f.queued, "in_flight": f.in_flight, "rejected_by_reason": dict(f.rejected_by_reason)}
                    for k, f in self.figures.items()}


class Unlimited:
    """The place of a request on a server without per-caller limits."""

    identity = ""
    state = "running"
    engine_held = False

    def start(self) -> bool:
        return True

    def release(self) -> None:
        pass

    close = release

    def used(self, tokens: int) -> None:
        pass

    def reserve(self, tokens: int) -> None:
        pass


UNLIMITED = Unlimited()


def retry_after_seconds(exc: BaseException) -> int | None:
    """Whole seconds for a Retry-After header (at least 1), or None."""
    ra = getattr(exc, "retry_after", None)
    return None if ra is None else max(1, math.ceil(ra))


def current_caller() -> str:
    """The identity the auth layer bound for this request (gRPC and HTTP bind `caller`)."""
    import structlog

    return str(structlog.contextvars.get_contextvars().get("caller") or "anonymous")
