"""The server-wide speculation policy (SetPolicy, SIGHUP) and how it shapes a request."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from edgespec.errors import BadRequest
from edgespec.server.config import ServerConfig, SpeculationConfig
from edgespec.types import MAX_DRAFT_TOKENS, MAX_TREE_DEPTH, MAX_TREE_NODES


@dataclass(frozen=True)
class Policy:
    speculation: str = "auto"  # auto: honour request modes | off: force plain decoding
    default_mode: str = "auto"  # what a request's AUTO means
    draft_tokens: int = 4
    tree_nodes: int = 16
    tree_depth: int = 6
    ngram: bool = True
    max_draft_tokens: int = MAX_DRAFT_TOKENS
    max_tree_nodes: int = MAX_TREE_NODES
    max_tree_depth: int = MAX_TREE_DEPTH
    max_tokens: int = 4096
    default_max_tokens: int = 256

    def __post_init__(self) -> None:
        if self.speculation not in ("auto", "off"):
            raise BadRequest("speculation", f"must be auto or off, got {self.speculation!r}")
        for name, hi in (("max_draft_tokens", MAX_DRAFT_TOKENS), ("max_tree_nodes", MAX_TREE_NODES),
                         ("max_tree_depth", MAX_TREE_DEPTH), ("max_tokens", 1 << 20)):
            v = getattr(self, name)
            if not 1 <= v <= hi:
                raise BadRequest(name, f"must be in [1, {hi}], got {v}")

    @classmethod
    def from_config(cls, spec: SpeculationConfig, server: ServerConfig) -> "Policy":
        return cls(
            speculation=spec.policy,
            default_mode=spec.mode,
            draft_tokens=spec.draft_tokens,
            tree_nodes=spec.tree_nodes,
            tree_depth=spec.tree_depth,
            ngram=spec.ngram,
            max_draft_tokens=spec.max_draft_tokens,
            max_tree_nodes=spec.max_tree_nodes,
            max_tree_depth=spec.max_tree_depth,
            max_tokens=server.max_tokens,
            default_max_tokens=min(server.default_max_tokens, server.max_tokens),
        )

    def replace(self, **changes: object) -> "Policy":
        return dataclasses.replace(self, **changes)
