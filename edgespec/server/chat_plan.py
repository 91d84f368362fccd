"""One memory plan for every chat model of the daemon: each model's weights, KV cache, compute
buffers and caches (edgespec.plan), the [embedding] and [rerank] contexts beside them, and the
budget they share ([models] memory_bytes, else the device's memory less the headroom).

The rule the daemon keeps at run time (chat_models.ChatModels): the side contexts and the loaded
chat models together stay within the budget. So at start: the side contexts and the models that
load at start must fit together, and each model must fit beside the side contexts alone (or it
could never load)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from edgespec.config import EngineConfig
from edgespec.errors import ConfigError
from edgespec.plan import DEFAULT_HEADROOM, MemoryPlan, fmt_bytes, plan_for_config


@dataclass(frozen=True)
class ModelsPlan:
    """Every chat model's plan by name (the default first), the side contexts' bytes, the budget."""

    chat: tuple[tuple[str, MemoryPlan, str], ...]  # (name, plan, load)
    sides: MemoryPlan | None  # the default model's plan with [embedding]/[rerank] (their parts only count)
    budget_bytes: int
    device: str

    @property
    def side_bytes(self) -> int:
        if self.sides is None:
            return 0
        return sum(m.total() for m in (self.sides.embedding, self.sides.rerank) if m is not None)

    def need(self, name: str) -> int:
        """A model's bytes, with the headroom the budget leaves out."""
        return next(p.total_bytes for n, p, _ in self.chat if n == name)

    @property
    def at_start(self) -> int:
        return self.side_bytes + sum(p.total_bytes for _, p, load in self.chat if load == "start")

    @property
    def all_bytes(self) -> int:
        return self.side_bytes + sum(p.total_bytes for _, p, _ in self.chat)

    def problem(self) -> str | None:
        """Why this plan cannot serve (None: it can)."""
        if self.at_start > self.budget_bytes:
            return (f"the models loaded at start need {fmt_bytes(self.at_start)} together, the budget is "
                    f"{fmt_bytes(self.budget_bytes)} ({self.device}): set load = \"on_demand\" on some [[chat]] "
                    "entries, raise models.memory_bytes, or lower n_ctx or parallel")
        for name, p, _ in self.chat:
            if self.side_bytes + p.total_bytes > self.budget_bytes:
                return (f"chat model {name!r} needs {fmt_bytes(p.total_bytes)} beside the embedding and rerank "
                        f"contexts' {fmt_bytes(self.side_bytes)}: more than the budget of "
                        f"{fmt_bytes(self.budget_bytes)} ({self.device})")
        return None

    def lines(self) -> list[str]:
        """What `edgespec plan --config` prints for it."""
        out = [f"chat model {name} ({load}): {fmt_bytes(p.total_bytes)}" for name, p, load in self.chat]
        if self.side_bytes:
            out.append(f"embedding and rerank contexts: {fmt_bytes(self.side_bytes)}")
        out.append(f"all chat models at once: {fmt_bytes(self.all_bytes)}; loaded at start: "
                   f"{fmt_bytes(self.at_start)}; budget {fmt_bytes(self.budget_bytes)} ({self.device})"
                   + ("" if self.all_bytes <= self.budget_bytes else
                      "; idle models are unloaded (after keep_alive) to load another"))
        return out


def budget_bytes(memory_bytes: int, engine: EngineConfig) -> tuple[int, str]:
    """([models] memory_bytes, or the device's memory less DEFAULT_HEADROOM), and what it is."""
    if memory_bytes:
        return int(memory_bytes), "models.memory_bytes"
    from edgespec.backend import device_memory

    total, name, _ = device_memory(gpu=engine.target.n_gpu_layers != 0)
    return int(total * (1 - DEFAULT_HEADROOM)), name


def models_plan(default: EngineConfig, entries: Sequence[Any], memory_bytes: int, embedding: Any = None,
                rerank: Any = None, default_name: str = "default") -> ModelsPlan:
    """The plan of the default model (`default`) and the [[chat]] `entries` (ChatEntry)."""
    gpu = default.target.n_gpu_layers != 0
    sides = plan_for_config(default, gpu=gpu, embedding=embedding, rerank=rerank)
    chat = [(default_name, replace(sides, embedding=None, rerank=None), "start")]
    chat += [(e.name, plan_for_config(e.engine, gpu=e.engine.target.n_gpu_layers != 0), e.load) for e in entries]
    budget, device = budget_bytes(memory_bytes, default)
    return ModelsPlan(tuple(chat), sides, budget, device)


def check_models_memory(default: EngineConfig, entries: Sequence[Any], memory_bytes: int, embedding: Any = None,
                        rerank: Any = None) -> None:
    """ConfigError naming models.memory_bytes when the chat models cannot be served within the budget."""
    plan = models_plan(default, entries, memory_bytes, embedding, rerank)
    if (why := plan.problem()) is not None:
        raise ConfigError("models.memory_bytes", why)
