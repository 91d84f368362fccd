"""Adaptive speculation controller: per-step choice of plain / chain / tree and its shape from a measured
cost model and this request's acceptance, with a per-request circuit breaker. Pure Python; the engine
calls `Controller.decide()` while it schedules a step, `Controller.commit()` as the step begins
(`choose()` does both) and `Controller.observe()` after it."""

from edgespec.controller.acceptance import AcceptancePrior, AcceptanceWindow
from edgespec.controller.breaker import CLOSED, HALF_OPEN, OPEN
from edgespec.controller.config import ControllerConfig
from edgespec.controller.controller import Controller, Decision
from edgespec.controller.cost import CostModel
from edgespec.controller.policy import Choice, ShapePolicy, expansion_batches
from edgespec.controller.shapes import PLAIN, Shape, StepOutcome, chain, eagle, plain_outcome, runner_ups

__all__ = [
    "AcceptancePrior",
    "AcceptanceWindow",
    "CLOSED",
    "Choice",
    "Controller",
    "ControllerConfig",
    "CostModel",
    "Decision",
    "HALF_OPEN",
    "OPEN",
    "PLAIN",
    "Shape",
    "ShapePolicy",
    "StepOutcome",
    "chain",
    "eagle",
    "expansion_batches",
    "plain_outcome",
    "runner_ups",
]
