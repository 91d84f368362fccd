"""The server-wide speculation policy (SetPolicy, SIGHUP) and how it shapes a request."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

from edgespec.errors import BadRequest
from edgespec.sampling import SamplingParams, check_sampling
from edgespec.server.config import LimitsConfig, ServerConfig, SpeculationConfig
from edgespec.settings import SPECULATION, check_fields, setting, settings_class
from edgespec.types import SpeculationParams

# Policy field -> the config key it starts from (defaults and ranges declared in edgespec.settings)
POLICY_KEYS = {
    "speculation": ("speculation", "policy"),  # auto: honour request modes | off: force plain decoding
    "default_mode": ("speculation", "mode"),  # what a request's AUTO means
    **{k: ("speculation", k) for k in ("draft_tokens", "tree_nodes", "tree_depth", "ngram", "max_draft_tokens",
                                       "max_tree_nodes", "max_tree_depth")},
    "max_tokens": ("server", "max_tokens"),
    "default_max_tokens": ("server", "default_max_tokens"),
}


def _check(self: Any) -> None:
    """Every field in its declared range (an admin override too): BadRequest names the field."""
    for attr, (section, key) in POLICY_KEYS.items():
        msg = setting(section, key).problem(getattr(self, attr))
        if msg:
            raise BadRequest(attr, msg)


def _from_config(cls: type, spec: SpeculationConfig, server: ServerConfig) -> Any:
    values = {"speculation": spec, "server": server}
    policy = cls(**{attr: getattr(values[section], key) for attr, (section, key) in POLICY_KEYS.items()})
    return policy.replace(default_max_tokens=min(server.default_max_tokens, server.max_tokens))


if TYPE_CHECKING:  # made at run time from the declaration table, one field per key: opaque to mypy
    Policy: TypeAlias = Any
else:
    Policy = settings_class(
        "Policy", POLICY_KEYS, "The running daemon's speculation policy: the config's [speculation] and "
        "[server] max_tokens, with the admin's overrides on top.", __name__,
        namespace={"__post_init__": _check, "from_config": classmethod(_from_config), "replace": dataclasses.replace},
    )


# ---- what a request asks for, checked in one place for gRPC and HTTP ----------------------------

SHAPE_CAPS = {"draft_tokens": "max_draft_tokens", "tree_nodes": "max_tree_nodes", "tree_depth": "max_tree_depth"}
_REAL = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def sampling_for(policy: Any, limits: LimitsConfig, values: Mapping[str, Any], *, prefix: str = "",
                 temperature: float | None = None) -> SamplingParams:
    """A request's SamplingParams from the fields it set (`values`: temperature, top_k, top_p,
    min_p, seed, max_tokens, None = unset; stop). Checked by sampling.check_sampling against the
    declared ranges, max_tokens <= policy.max_tokens and the [limits] stop bounds; BadRequest names
    the field as the API does (`prefix` "sampling." for gRPC). Unset: the declared defaults,
    max_tokens policy.default_max_tokens, temperature `temperature` when given."""
    check_sampling(dict(values), prefix=prefix, max_tokens_limit=policy.max_tokens,
                   max_stop_strings=limits.max_stop_strings, max_stop_chars=limits.max_stop_chars)
    given = {k: (float(v) if k in _REAL else v) for k, v in values.items() if v is not None}
    fallback = {"max_tokens": policy.default_max_tokens}
    if temperature is not None:
        fallback["temperature"] = temperature
    return SamplingParams(**{**fallback, **given})


def check_ignore_eos(sampling: SamplingParams, constrained: bool, field: str) -> None:
    """ignore_eos with a constraint (response_format, a grammar, tool calls): refused, naming
    `field`. A grammar ends the answer with an end-of-generation token, which ignore_eos bans."""
    if sampling.ignore_eos and constrained:
        raise BadRequest(field, "cannot be combined with a constraint (response_format, a grammar or tool calls): "
                                "a constrained answer ends with the end-of-generation token it bans")


def speculation_for(policy: Any, mode: str, shape: Mapping[str, int | None], ngram: bool | None, *,
                    prefix: str = "") -> SpeculationParams:
    """A request's SpeculationParams: its mode (auto, plain, chain, tree) as the policy resolves
    it (the configured meaning of auto; off forces plain), each shape field it set (`shape`:
    draft_tokens, tree_nodes, tree_depth; None = unset) in [1, the policy's cap], the unset ones
    at the policy's defaults (capped). BadRequest names the field (`prefix` + name)."""
    if mode == "auto" and policy.default_mode != "auto":
        mode = "plain" if policy.default_mode == "off" else policy.default_mode
    if policy.speculation == "off":
        mode = "plain"
    caps = {k: getattr(policy, cap) for k, cap in SHAPE_CAPS.items()}
    check_fields(dict(shape), SPECULATION, prefix=prefix, caps=caps)
    if ngram is not None and not isinstance(ngram, bool):
        raise BadRequest(prefix + "ngram", f"must be true or false, got {ngram!r}")
    values = {k: min(getattr(policy, k), caps[k]) if shape.get(k) is None else shape[k] for k in SHAPE_CAPS}
    return SpeculationParams(mode=mode, ngram=policy.ngram if ngram is None else ngram, **values)  # type: ignore[arg-type]
