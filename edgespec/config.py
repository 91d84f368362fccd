"""Engine configuration: frozen dataclasses validated once at load.

The daemon's full TOML config (server, auth, tls, metrics, controller, ...) builds on these;
see edgespec/server/config.py. Each component gets only its own section.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from edgespec.errors import ConfigError

KV_TYPES = ("f16", "q8_0", "q4_0", "f32")


def edgespec_home() -> Path:
    return Path(os.environ.get("EDGESPEC_HOME", Path.home() / ".local/share/edgespec"))


def models_dir() -> Path:
    return edgespec_home() / "models"


# the largest tree a request may verify (types.MAX_TREE_NODES), plus its root
TREE_CELLS = 65


def shared_cells(parallel: int, n_ctx: int) -> int:
    """Cells of a context shared by `parallel` slots of `n_ctx` positions each, with room for the
    largest tree every slot may verify at once beyond its context."""
    return parallel * (n_ctx + TREE_CELLS)


@dataclass(frozen=True)
class ModelConfig:
    """One llama.cpp model + context."""

    path: str
    n_gpu_layers: int = 0  # -1 = all layers on the GPU (CUDA build)
    n_ctx: int = 4096
    n_batch: int = 512
    threads: int = 0  # 0 = os.cpu_count()
    # flash attention: on a CPU it skips the cells a token may not see, so its logits do not
    # depend on where its cells sit in the shared cache nor on the other requests' cells (without
    # it, the masked sums over the whole cache move logits by ~1e-2 between layouts); faster too
    flash_attn: bool = True
    kv_type: str = "f16"

    def validate(self, section: str) -> None:
        if not self.path:
            raise ConfigError(f"{section}.path", "is required")
        if self.n_gpu_layers < -1:
            raise ConfigError(f"{section}.n_gpu_layers", f"must be >= -1 (-1 = all), got {self.n_gpu_layers}")
        if not 128 <= self.n_ctx <= 1 << 20:
            raise ConfigError(f"{section}.n_ctx", f"must be in [128, 1048576], got {self.n_ctx}")
        if not 1 <= self.n_batch <= 1 << 16:
            raise ConfigError(f"{section}.n_batch", f"must be in [1, 65536], got {self.n_batch}")
        if self.threads < 0:
            raise ConfigError(f"{section}.threads", f"must be >= 0 (0 = all cores), got {self.threads}")
        if self.kv_type not in KV_TYPES:
            raise ConfigError(f"{section}.kv_type", f"must be one of {', '.join(KV_TYPES)}, got {self.kv_type!r}")

    @property
    def n_threads(self) -> int:
        return self.threads or os.cpu_count() or 1


@dataclass(frozen=True)
class EngineConfig:
    target: ModelConfig
    draft: ModelConfig | None  # None = model-free drafting only (n-gram)
    parallel: int = 1  # slots: requests decoded concurrently (each has its own KV caches)
    max_tree_leaves: int = 32  # n_seq_max - 1 for the target context
    # the most context tokens the draft absorbs at once: a longer prompt (or plain phase) is
    # drafted from its last `draft_window` tokens (drafters/model.py)
    draft_window: int = 256
    # a slot keeps the KV of its last prompt's prefill; a request whose prompt starts the same way
    # prefills only from the last whole n_batch chunk they share (engine.reusable_prefix)
    prompt_cache: bool = True
    # a prompt is prefilled in pieces inside the ticks; beside decoding sessions a piece may cost
    # at most this many times the tick's decode work (0: whole n_batch chunks, streams wait)
    prefill_share: float = 1.5

    def validate(self) -> None:
        self.target.validate("target")
        if self.draft is not None:
            self.draft.validate("draft")
        if not 1 <= self.parallel <= 64:
            raise ConfigError("engine.parallel", f"must be in [1, 64], got {self.parallel}")
        if not 1 <= self.max_tree_leaves <= 255:
            raise ConfigError("engine.max_tree_leaves", f"must be in [1, 255], got {self.max_tree_leaves}")
        if not 16 <= self.draft_window <= 1 << 20:
            raise ConfigError("engine.draft_window", f"must be in [16, 1048576], got {self.draft_window}")
        if not 0 <= self.prefill_share <= 100:
            raise ConfigError("engine.prefill_share", f"must be in [0, 100], got {self.prefill_share}")
        if not isinstance(self.prompt_cache, bool):
            raise ConfigError("engine.prompt_cache", f"must be true or false, got {self.prompt_cache!r}")
