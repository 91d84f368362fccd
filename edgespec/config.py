"""Engine configuration: frozen dataclasses validated once at load.

The daemon's full TOML config (server, auth, tls, metrics, controller, ...) builds on these;
see edgespec/server/config.py. Each component gets only its own section.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

from edgespec.errors import ConfigError
from edgespec.settings import KV_TYPES as KV_TYPES  # re-exported
from edgespec.settings import SECTIONS, setting


def edgespec_home() -> Path:
    return Path(os.environ.get("EDGESPEC_HOME", Path.home() / ".local/share/edgespec"))


def models_dir() -> Path:
    return edgespec_home() / "models"


# the largest tree a request may verify (settings.MAX_TREE_NODES), plus its root
TREE_CELLS = 65
# a padded forward's inert tokens (backend.Context, `[speculation] pad_forwards`): a forward of m
# tokens pads up to the next fixed width (controller/widths.py), below 2m up to the widest, 64
SCRATCH_CELLS = 32


def shared_cells(parallel: int, n_ctx: int) -> int:
    """Cells of a context shared by `parallel` slots of `n_ctx` positions each, with room for the
    largest tree every slot may verify at once beyond its context and for a padded forward's
    inert tokens (removed right after it)."""
    return parallel * (n_ctx + TREE_CELLS) + SCRATCH_CELLS


_MODEL = SECTIONS["target"]  # [target] and [draft] declare the same model keys


@dataclass(frozen=True)
class ModelConfig:
    """One llama.cpp model + context ([target] or [draft]; defaults and ranges from edgespec.settings)."""

    path: str
    n_gpu_layers: int = _MODEL["n_gpu_layers"].default  # -1 = all layers on the GPU (CUDA build)
    n_ctx: int = _MODEL["n_ctx"].default
    n_batch: int = _MODEL["n_batch"].default
    threads: int = _MODEL["threads"].default  # 0 = os.cpu_count()
    # flash attention: on a CPU it skips the cells a token may not see, so its logits do not
    # depend on where its cells sit in the shared cache nor on the other requests' cells (without
    # it, the masked sums over the whole cache move logits by ~1e-2 between layouts); faster too
    flash_attn: bool = _MODEL["flash_attn"].default
    kv_type: str = _MODEL["kv_type"].default

    def validate(self, section: str) -> None:
        if not self.path:
            raise ConfigError(f"{section}.path", "is required")
        _check(self, {f.name: (section, f.name) for f in fields(self) if f.name != "path"})

    @property
    def n_threads(self) -> int:
        return self.threads or os.cpu_count() or 1


# EngineConfig field -> the (section, key) a user writes in the TOML file
ENGINE_KEYS = {
    "parallel": ("server", "parallel"),
    "max_tree_leaves": ("server", "max_tree_leaves"),
    "draft_window": ("draft", "window"),
    "prompt_cache": ("server", "prompt_cache"),
    "prompt_cache_bytes": ("server", "prompt_cache_bytes"),
    "prompt_cache_scope": ("server", "prompt_cache_scope"),
    "prefill_share": ("server", "prefill_share"),
    "suffix_cache": ("speculation", "suffix_cache"),
    "suffix_cache_bytes": ("speculation", "suffix_cache_bytes"),
    "suffix_cache_store": ("speculation", "suffix_cache_store"),
    "suffix_cache_scope": ("speculation", "suffix_cache_scope"),
    "fast_kernels": ("target", "fast_kernels"),
    "pad_forwards": ("speculation", "pad_forwards"),
    "constraint_step_seconds": ("limits", "constraint_step_seconds"),
    "constraint_tick_seconds": ("limits", "constraint_tick_seconds"),
    "constraint_burst_seconds": ("limits", "constraint_burst_seconds"),
    "constraint_share": ("limits", "constraint_share"),
    "constraint_wait_seconds": ("limits", "constraint_wait_seconds"),
}


def _check(cfg: object, keys: dict[str, tuple[str, str]]) -> None:
    """Raise ConfigError naming the first field outside its declared range, as `section.key`."""
    for attr, (section, key) in keys.items():
        msg = setting(section, key).problem(getattr(cfg, attr))
        if msg:
            raise ConfigError(f"{section}.{key}", msg)


@dataclass(frozen=True)
class EngineConfig:
    target: ModelConfig
    draft: ModelConfig | None  # None = model-free drafting only (n-gram)
    # slots: requests decoded concurrently (each has its own KV caches); one for a library or CLI
    # engine, the daemon passes [server] parallel
    parallel: int = 1
    max_tree_leaves: int = setting("server", "max_tree_leaves").default  # n_seq_max - 1 for the target context
    # the most context tokens the draft absorbs at once: a longer prompt (or plain phase) is
    # drafted from its last `draft_window` tokens (drafters/model.py)
    draft_window: int = setting("draft", "window").default
    # a slot keeps the KV of its last prompt's prefill; a request whose prompt starts the same way
    # prefills only what follows the prefix they share (slots.reusable_prefix, engine.reuse_chunk)
    prompt_cache: bool = setting("server", "prompt_cache").default
    # host memory for kept prefills beyond the slots' own (edgespec/prompt_store.py; 0 = none), one
    # partition per caller unless pooled
    prompt_cache_bytes: int = setting("server", "prompt_cache_bytes").default
    prompt_cache_scope: str = setting("server", "prompt_cache_scope").default
    # a prompt is prefilled in pieces inside the ticks; beside decoding sessions a piece may cost
    # at most this many times the tick's decode work (0: whole n_batch chunks, streams wait)
    prefill_share: float = setting("server", "prefill_share").default
    # the cross-request suffix cache (drafters/suffix.py): on/off, its memory bound, what it keeps
    # of a finished request, one partition per caller or pooled
    suffix_cache: bool = setting("speculation", "suffix_cache").default
    suffix_cache_bytes: int = setting("speculation", "suffix_cache_bytes").default
    suffix_cache_store: str = setting("speculation", "suffix_cache_store").default
    suffix_cache_scope: str = setting("speculation", "suffix_cache_scope").default
    # a CPU target's quantized weights repacked and ggml's tiled K-quant kernel on: llama.cpp's own
    # speed, exactness "up to float rounding" (backend.Model, Engine.exactness)
    fast_kernels: bool = setting("target", "fast_kernels").default
    # an EAGLE-3 head loaded beside the draft model (`[draft] head`): each request then drafts with
    # the one the measured costs and acceptances favour at the load it meets (Engine.choose_drafter);
    # its context takes the [draft] section's settings. None: one drafter (`draft`, a model or a head)
    head: ModelConfig | None = None
    # forwards padded to a few fixed widths, the padding in a scratch sequence (backend.Context):
    # "auto" = on when the target is offloaded to a GPU (pads_forwards)
    pad_forwards: str | bool = setting("speculation", "pad_forwards").default
    # the engine thread's CPU time grammar masks may take (constraint.MaskLimits): one request's in a
    # step, all requests' in a tick (past these it fails); over its run one request's are paced by
    # a bucket (a burst, a share), a request waiting for it at most constraint_wait_seconds a step
    constraint_step_seconds: float = setting("limits", "constraint_step_seconds").default
    constraint_tick_seconds: float = setting("limits", "constraint_tick_seconds").default
    constraint_burst_seconds: float = setting("limits", "constraint_burst_seconds").default
    constraint_share: float = setting("limits", "constraint_share").default
    constraint_wait_seconds: float = setting("limits", "constraint_wait_seconds").default

    def pads_forwards(self, gpu: bool) -> bool:
        """Whether the forwards are padded, `gpu`: whether the target's layers run on a GPU."""
        return gpu if self.pad_forwards == "auto" else bool(self.pad_forwards)

    def validate(self) -> None:
        """Raise ConfigError naming the TOML key (`server.parallel`, `draft.window`, ...)."""
        self.target.validate("target")
        if self.draft is not None:
            self.draft.validate("draft")
        if self.head is not None:
            if self.draft is None:
                raise ConfigError("draft.head", "needs a draft model beside it (draft.enabled = true)")
            self.head.validate("draft")
        _check(self, ENGINE_KEYS)
