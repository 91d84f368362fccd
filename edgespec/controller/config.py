"""ControllerConfig: every knob of the adaptive controller and its circuit breaker.

Frozen, one field per `[controller]` key declared in edgespec.settings (type, default, range,
help), validated once (`validate()` raises ConfigError naming the key and its allowed range), built
from a TOML `[controller]` table by `from_dict` (unknown keys are rejected by name).
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any, TypeAlias

from edgespec.errors import ConfigError
from edgespec.settings import CONTROLLER_MAX_DEPTH, CONTROLLER_MAX_NODES, CONTROLLER_MAX_WIDTH, SECTIONS, section_class

SECTION = "controller"
MAX_DEPTH_LIMIT = CONTROLLER_MAX_DEPTH  # draft levels a shape may have
MAX_NODES_LIMIT = CONTROLLER_MAX_NODES  # verification nodes (excluding the root)
MAX_WIDTH_LIMIT = CONTROLLER_MAX_WIDTH  # children per expanded node / ranks tracked by the acceptance model


def validate(self: Any) -> Any:
    """Every key in its declared range (ConfigError naming `controller.<key>`), then the rules
    across keys."""
    for key, s in SECTIONS[SECTION].items():
        msg = s.problem(getattr(self, key))
        if msg:
            raise ConfigError(s.name, msg)
    if self.min_depth > self.max_depth:
        raise ConfigError(f"{SECTION}.min_depth", f"must be <= max_depth ({self.max_depth}), got {self.min_depth}")
    if self.max_cooldown_tokens < self.cooldown_tokens:
        raise ConfigError(
            f"{SECTION}.max_cooldown_tokens",
            f"must be >= cooldown_tokens ({self.cooldown_tokens}), got {self.max_cooldown_tokens}",
        )
    return self


def from_dict(cls: type, d: dict[str, Any] | None) -> Any:
    """Build from a TOML `[controller]` table; unknown keys are rejected by name."""
    d = dict(d or {})
    known = {f.name for f in fields(cls)}
    for key in d:
        if key not in known:
            raise ConfigError(f"{SECTION}.{key}", f"unknown key (known: {', '.join(sorted(known))})")
    return cls(**d).validate()


if TYPE_CHECKING:  # made at run time from the declaration table, one field per key: opaque to mypy
    ControllerConfig: TypeAlias = Any
else:
    ControllerConfig = section_class(
        "ControllerConfig", SECTION,
        "Every knob of the adaptive controller and its circuit breaker ([controller] in edgespec.settings).",
        __name__, namespace={"validate": validate, "from_dict": classmethod(from_dict), "as_dict": asdict},
    )
