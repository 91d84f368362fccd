"""[audit]: a fraction of the finished greedy speculative requests is decoded again in plain mode
while the engine is idle (a shadow), and the two outputs compared: a match is the exactness
claim checked on live traffic, a mismatch is counted and logged with the audited request's id."""

from __future__ import annotations

import collections
import random
import threading

from edgespec.logs import get_logger
from edgespec.server.loop_contract import Job
from edgespec.server.metrics import Metrics
from edgespec.types import GenerationResult, SpeculationParams

log = get_logger("edgespec.server.engine")

FINISHED = ("length", "eos", "stop")  # a request decoded to its end: its output is a verdict


def _shadow_fields(result: GenerationResult) -> dict:
    """How an [audit] shadow decoded, for its log line: plain steps only and no draft forward is
    what makes it a check."""
    return {"steps_per_mode": dict(result.stats.steps_per_mode), "draft_forwards": result.stats.draft_forwards}


class ShadowAudit:
    """Shadows of `fraction` of the finished greedy speculative requests, at most `size` waiting
    (the oldest dropped); `seed` picks which. The queue is under `lock` (the intake's)."""

    def __init__(self, fraction: float, size: int, seed: int | None, metrics: Metrics, lock: threading.Lock):
        self.fraction = fraction
        self.metrics = metrics
        self.lock = lock
        self.waiting: collections.deque[Job] = collections.deque(maxlen=size)
        self._rng = random.Random(seed)

    def offer(self, job: Job, result: GenerationResult) -> None:
        """Queue a plain re-decode of `job` (finished as `result`) if it is one to audit."""
        if (self.fraction <= 0 or job.speculation.mode == "plain" or job.sampling.temperature > 1e-5
                or result.finish_reason not in FINISHED or not job.prompt_tokens
                or self._rng.random() >= self.fraction):
            return
        shadow = Job(request_id=f"shadow-{job.request_id}", sampling=job.sampling,
                     speculation=SpeculationParams(mode="plain"), constraint=job.constraint,
                     prompt_tokens=job.prompt_tokens, shadow_of=(job.request_id, tuple(result.token_ids)))
        with self.lock:
            if len(self.waiting) == self.waiting.maxlen:
                self.metrics.shadow.inc(label="skipped")
            self.waiting.append(shadow)

    def next(self) -> Job | None:
        """The oldest shadow waiting, for an idle engine (under the lock)."""
        return self.waiting.popleft() if self.waiting else None

    def verdict(self, job: Job, result: GenerationResult) -> None:
        """A shadow finished as `result`: compare it with the audited request's output."""
        assert job.shadow_of is not None
        rid, expected = job.shadow_of
        if result.finish_reason not in FINISHED:  # cancelled by a drain: not a verdict
            self.metrics.shadow.inc(label="skipped")
            return
        if tuple(result.token_ids) == expected:
            self.metrics.shadow.inc(label="match")
            log.info("audit_shadow_match", request_id=rid, tokens=len(expected), **_shadow_fields(result))
            return
        k = next((i for i, (a, b) in enumerate(zip(result.token_ids, expected)) if a != b),
                 min(len(expected), len(result.token_ids)))
        self.metrics.shadow.inc(label="mismatch")
        log.warning("audit_shadow_mismatch", request_id=rid, first_differing_token=k,
                    speculative_tokens=len(expected), plain_tokens=len(result.token_ids), **_shadow_fields(result))
