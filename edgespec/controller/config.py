"""ControllerConfig: every knob of the adaptive controller and its circuit breaker.

Frozen, validated once (`validate()` raises ConfigError naming the key and its allowed range),
built from a TOML `[controller]` table by `from_dict` (unknown keys are rejected by name).
docs/controller.md documents every key and its default.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from edgespec.errors import ConfigError

SECTION = "controller"
MAX_DEPTH_LIMIT = 16  # draft levels a shape may have
MAX_NODES_LIMIT = 128  # verification nodes (excluding the root)
MAX_WIDTH_LIMIT = 8  # children per expanded node / ranks tracked by the acceptance model


@dataclass(frozen=True)
class ControllerConfig:
    # acceptance model
    window: int = 32  # speculative steps of this request the acceptance estimate looks at
    decay: float = 1.0  # weight of a step in the window = decay**age (1 = plain sliding window)
    drift_threshold: float = 4.0  # CUSUM alarm level for a sudden acceptance drop (0 = off)
    drift_drop: float = 0.5  # the drop the detector looks for: acceptance falling to this fraction
    prior_weight: float = 1.0  # pseudo-count (in trials) of the cross-request prior in each estimate
    prior_alpha: float = 0.2  # how fast the cross-request prior follows finished requests (EWMA)
    # circuit breaker
    open_margin: float = 0.1  # open when the best expected speedup < 1 - open_margin ...
    open_after_steps: int = 2  # ... for this many consecutive steps
    close_margin: float = 0.05  # close when the probes' expected speedup > 1 + close_margin
    min_dwell_steps: int = 4  # speculative steps the breaker stays closed before it may open again
    cooldown_tokens: int = 32  # tokens decoded plainly (zero drafting) before the first probe
    max_cooldown_tokens: int = 512  # cap of the cooldown after repeated failed probes
    cooldown_growth: float = 2.0  # cooldown multiplier after each failed probe
    probe_steps: int = 3  # speculative steps of a half-open probe
    probe_depth: int = 2  # the probe is a chain of this depth
    probe_cost_fraction: float = 0.05  # skip a probe whose draft catch-up would cost more than this
    # fraction of the request's remaining plain decoding (short requests after a long plain phase)
    # shapes
    min_depth: int = 1
    max_depth: int = 8
    max_nodes: int = 64
    max_width: int = 4
    # passed to the shapes auto chooses: stop drafting when the best path's draft probability falls
    # below this (measured, fixed chain of 4: 0.82x -> 1.0x plain at 0.5-0.85 when drafting is dear)
    stop_prob: float = 0.6
    # the path estimate stop_prob is compared with: the product of calibrated acceptance
    # (P(accepted | draft probability), learnt from this request and across requests) if true, the
    # draft's own cumulative probability if false (measured: with an 8-bit draft that is accepted
    # ~97 % of the time, raw probabilities stopped chains at depth ~3 and cost 7 % of the speed)
    calibrate_stop: bool = True
    # the request's first step decodes plainly: its first token comes after one target forward, as
    # in plain decoding, and the draft absorbs the prompt in the second step, not before that token
    first_token_plain: bool = True
    enable_chain: bool = True
    enable_tree: bool = True  # EAGLE-2 style expanded trees
    enable_runner_ups: bool = True  # chain + the draft's runner-up tokens as leaves
    enable_ngram: bool = True  # model-free prompt-lookup drafts (the only drafter without a draft model)
    # cost model
    ewma_alpha: float = 0.1  # weight of one online timing in the cost model

    def validate(self) -> "ControllerConfig":
        def rng(key: str, lo: float, hi: float, *, integer: bool) -> None:
            v = getattr(self, key)
            ok_type = (isinstance(v, int) and not isinstance(v, bool)) if integer else (
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            )
            if not ok_type or not lo <= v <= hi:
                kind = "an integer" if integer else "a number"
                raise ConfigError(f"{SECTION}.{key}", f"must be {kind} in [{lo}, {hi}], got {v!r}")

        rng("window", 1, 4096, integer=True)
        rng("decay", 0.5, 1.0, integer=False)
        rng("drift_threshold", 0.0, 100.0, integer=False)
        rng("drift_drop", 0.01, 0.99, integer=False)
        rng("prior_weight", 0.0, 1000.0, integer=False)
        rng("prior_alpha", 0.0, 1.0, integer=False)
        rng("open_margin", 0.0, 0.9, integer=False)
        rng("open_after_steps", 1, 1000, integer=True)
        rng("close_margin", 0.0, 10.0, integer=False)
        rng("min_dwell_steps", 0, 100000, integer=True)
        rng("cooldown_tokens", 1, 1 << 20, integer=True)
        rng("max_cooldown_tokens", 1, 1 << 20, integer=True)
        rng("cooldown_growth", 1.0, 100.0, integer=False)
        rng("probe_steps", 1, 1000, integer=True)
        rng("probe_depth", 1, MAX_DEPTH_LIMIT, integer=True)
        rng("probe_cost_fraction", 0.0, 1.0, integer=False)
        rng("min_depth", 1, MAX_DEPTH_LIMIT, integer=True)
        rng("max_depth", 1, MAX_DEPTH_LIMIT, integer=True)
        rng("max_nodes", 1, MAX_NODES_LIMIT, integer=True)
        rng("max_width", 1, MAX_WIDTH_LIMIT, integer=True)
        rng("stop_prob", 0.0, 1.0, integer=False)
        rng("ewma_alpha", 0.0, 1.0, integer=False)
        if self.min_depth > self.max_depth:
            raise ConfigError(f"{SECTION}.min_depth", f"must be <= max_depth ({self.max_depth}), got {self.min_depth}")
        if self.max_cooldown_tokens < self.cooldown_tokens:
            raise ConfigError(
                f"{SECTION}.max_cooldown_tokens",
                f"must be >= cooldown_tokens ({self.cooldown_tokens}), got {self.max_cooldown_tokens}",
            )
        for key in ("enable_chain", "enable_tree", "enable_runner_ups", "enable_ngram", "calibrate_stop",
                    "first_token_plain"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{SECTION}.{key}", f"must be true or false, got {getattr(self, key)!r}")
        return self

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "ControllerConfig":
        """Build from a TOML `[controller]` table; unknown keys are rejected by name."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ConfigError(f"{SECTION}.{key}", f"unknown key (known: {', '.join(sorted(known))})")
        return cls(**d).validate()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
