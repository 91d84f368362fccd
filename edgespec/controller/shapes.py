"""What the controller decides (`Shape`) and learns (`StepOutcome`): both live below every package
in edgespec/shape.py (re-exported here), with the controller's plain outcome."""

from __future__ import annotations

from edgespec.shape import PLAIN, Shape, ShapeMode, StepOutcome, calib_bucket, chain, eagle, runner_ups

__all__ = ["PLAIN", "Shape", "ShapeMode", "StepOutcome", "calib_bucket", "chain", "eagle", "plain_outcome",
           "runner_ups"]


def plain_outcome(verify_seconds: float, emitted: int = 1, overhead_seconds: float = 0.0) -> StepOutcome:
    return StepOutcome(PLAIN, (), (0,), emitted, 0.0, (), verify_seconds, 1, 0, overhead_seconds)
