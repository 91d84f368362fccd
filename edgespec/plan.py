"""Memory plan for a target + draft pair: will both models, their KV caches and compute buffers fit?

Pure: reads GGUF metadata with the `gguf` package (never llama_cpp), does arithmetic, returns data.

Per model: ONE context shared by every slot (the batched engine verifies all slots' trees in one
forward; edgespec/engine.py), holding all slots' cells:
    weights  = sum of the tensors' data bytes (what llama_model_size() reports)
    cells    = parallel * (n_ctx + 65) rounded up to 256 (llama.cpp pads the cache; 65: the
               largest tree a slot verifies beyond its context)
    kv       = cells * n_layer * n_head_kv * (key_length + value_length) * bytes(kv_type)
    compute  = 4 * n_ubatch * (max(n_vocab, attn) + n_ff + n_embd)        [f32 scratch]
               attn = n_head * cells without flash attention (the KQ matrix), else 0;
               the logits row per batch token dominates small models (measured within ~2 % of
               llama.cpp's "compute buffer size" for SmolLM2-135M at n_ubatch 64..512)
    output   = 4 * n_vocab * n_outputs                                     [logit rows per decode]
total = sum over the models of weights + kv + compute + output.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from edgespec.config import KV_TYPES, EngineConfig, shared_cells
from edgespec.errors import ConfigError, ModelError

GIB = 1 << 30
MIB = 1 << 20
# bytes per KV element: quantised types store blocks of 32 values (+ one f16 scale)
KV_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
KV_PAD = 256
# A separate draft model pays off when it is ~3-5 % of the target's parameters.
DRAFT_RATIO_BAND = (0.03, 0.05)
DEFAULT_HEADROOM = 0.05  # keep 5 % of the device free (fragmentation, CUDA context, driver)
CUDA_CONTEXT_BYTES = 512 * MIB  # CUDA runtime + cuBLAS workspace per process, roughly


@dataclass(frozen=True)
class ModelFacts:
    """What the GGUF header says about one model."""

    path: str
    arch: str
    n_params: int
    weights_bytes: int
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    key_length: int
    value_length: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int

    def kv_bytes_per_cell(self, kv_type: str) -> float:
        """Bytes one cached token costs across all layers (K and V)."""
        return self.n_layer * self.n_head_kv * (self.key_length + self.value_length) * KV_BYTES[kv_type]


@dataclass(frozen=True)
class ModelPlan:
    role: str  # "target" | "draft" | "head" (an EAGLE-3 head as the draft)
    facts: ModelFacts
    weights_bytes: int
    kv_bytes: int  # the shared context: every slot's cells
    compute_bytes: int
    output_bytes: int

    def total(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes + self.output_bytes


@dataclass(frozen=True)
class MemoryPlan:
    target: ModelPlan
    draft: ModelPlan | None
    n_ctx: int
    parallel: int
    kv_type: str
    n_ubatch: int
    flash_attn: bool
    overhead_bytes: int  # per-process runtime (CUDA context) counted once
    draft_ratio: float | None  # draft params / target params
    warnings: tuple[str, ...] = field(default_factory=tuple)
    embedding: ModelPlan | None = None  # the [embedding] context (weights 0 when it shares the target's)
    rerank: ModelPlan | None = None  # the [rerank] context (weights 0 when it shares the target's)
    head: ModelPlan | None = None  # an EAGLE-3 head beside the draft model ([draft] head)
    # the bounds of the caches in host memory (the prompt store, the suffix cache), counted where
    # the device is the host's memory (a CPU engine)
    cache_bytes: int = 0

    @property
    def models(self) -> tuple[ModelPlan, ...]:
        return tuple(m for m in (self.target, self.draft, self.head, self.embedding, self.rerank) if m is not None)

    @property
    def total_bytes(self) -> int:
        return sum(m.total() for m in self.models) + self.overhead_bytes + self.cache_bytes

    def required_bytes(self, headroom: float = DEFAULT_HEADROOM) -> int:
        return math.ceil(self.total_bytes / (1 - headroom))

    def fits(self, device_bytes: int, headroom: float = DEFAULT_HEADROOM) -> bool:
        return self.required_bytes(headroom) <= device_bytes

    def as_dict(self, device_bytes: int | None = None, headroom: float = DEFAULT_HEADROOM) -> dict:
        out = {
            "n_ctx": self.n_ctx,
            "parallel": self.parallel,
            "kv_type": self.kv_type,
            "n_ubatch": self.n_ubatch,
            "flash_attn": self.flash_attn,
            "models": {
                m.role: {
                    "path": m.facts.path,
                    "arch": m.facts.arch,
                    "n_params": m.facts.n_params,
                    "weights_bytes": m.weights_bytes,
                    "kv_bytes": m.kv_bytes,
                    "compute_bytes": m.compute_bytes,
                    "output_bytes": m.output_bytes,
                    "total_bytes": m.total(),
                }
                for m in self.models
            },
            "overhead_bytes": self.overhead_bytes,
            "cache_bytes": self.cache_bytes,
            "total_bytes": self.total_bytes,
            "draft_ratio": self.draft_ratio,
            "warnings": list(self.warnings),
        }
        if device_bytes is not None:
            out.update(
                device_bytes=device_bytes,
                headroom=headroom,
                required_bytes=self.required_bytes(headroom),
                fits=self.fits(device_bytes, headroom),
            )
        return out


# the daemon's host memory beyond the models' plan: the interpreter and its libraries, the prompt
# store (server.prompt_cache_bytes, 256 MiB by default), the suffix cache (64 MiB) and buffers
HOST_ALLOWANCE_BYTES = 1 << 30
MEMORY_MAX_FACTOR = 1.25  # MemoryMax over MemoryHigh: reclaim pressure first, the OOM kill only past it


def systemd_memory(plan: MemoryPlan, extra_bytes: int = 0) -> str:
    """A systemd drop-in ([Service] MemoryHigh=, MemoryMax=) for the daemon this plan describes:
    MemoryHigh the plan's total plus HOST_ALLOWANCE_BYTES (and `extra_bytes`, e.g. a larger
    prompt store), where the kernel starts reclaiming; MemoryMax MEMORY_MAX_FACTOR above it, where
    a runaway daemon is killed instead of the host."""
    high = plan.total_bytes + HOST_ALLOWANCE_BYTES + max(0, extra_bytes)
    mib = lambda n: f"{math.ceil(n / (1 << 20))}M"
    return ("# written by `edgespec plan --systemd` (the models' plan plus the host's allowance)\n"
            f"[Service]\nMemoryHigh={mib(high)}\nMemoryMax={mib(high * MEMORY_MAX_FACTOR)}\n")


# --- GGUF metadata ----------------------------------------------------------------------------


def _scalar(fields: dict, key: str):
    f = fields.get(key)
    return None if f is None else f.contents()


def read_model_facts(path: str | os.PathLike[str]) -> ModelFacts:
    """Read sizes and shapes from a GGUF file's header and tensor table (no weights are loaded)."""
    from gguf import GGUFReader  # numpy memmap; imported lazily to keep CLI start-up fast

    p = Path(path)
    if not p.is_file():
        raise ModelError(f"model file not found: {p}")
    try:
        reader = GGUFReader(str(p))
    except Exception as exc:  # gguf raises ValueError/struct errors on non-GGUF files
        raise ModelError(f"{p}: not a readable GGUF file ({exc})") from exc
    fields = reader.fields
    arch = _scalar(fields, "general.architecture")
    if not arch:
        raise ModelError(f"{p}: GGUF has no general.architecture")

    def get(key: str, default: int | None = None) -> int:
        value = _scalar(fields, f"{arch}.{key}")
        if value is None:
            if default is None:
                raise ModelError(f"{p}: GGUF lacks {arch}.{key}")
            return default
        if isinstance(value, list):  # per-layer arrays (e.g. head_count_kv): plan for the largest
            value = max(value)
        return int(value)

    n_embd = get("embedding_length")
    n_head = get("attention.head_count")
    head_dim = n_embd // n_head
    vocab = _scalar(fields, f"{arch}.vocab_size")
    if vocab is None:
        tokens = fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else 0
    return ModelFacts(
        path=str(p),
        arch=str(arch),
        n_params=sum(int(t.n_elements) for t in reader.tensors),
        weights_bytes=sum(int(t.n_bytes) for t in reader.tensors),
        n_layer=get("block_count"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=get("attention.head_count_kv", n_head),
        key_length=get("attention.key_length", head_dim),
        value_length=get("attention.value_length", head_dim),
        n_ff=get("feed_forward_length", 4 * n_embd),
        n_vocab=int(vocab),
        n_ctx_train=get("context_length", 0),
    )


# --- the plan ---------------------------------------------------------------------------------


def _model_plan(
    role: str, facts: ModelFacts, *, n_ctx: int, parallel: int, kv_type: str, n_ubatch: int, n_outputs: int,
    flash_attn: bool
) -> ModelPlan:
    cells = shared_cells(parallel, n_ctx)
    cells = -(-cells // KV_PAD) * KV_PAD
    attn = 0 if flash_attn else facts.n_head * cells
    return ModelPlan(
        role=role,
        facts=facts,
        weights_bytes=facts.weights_bytes,
        kv_bytes=math.ceil(cells * facts.kv_bytes_per_cell(kv_type)),
        compute_bytes=4 * n_ubatch * (max(facts.n_vocab, attn) + facts.n_ff + facts.n_embd),
        output_bytes=4 * facts.n_vocab * n_outputs,
    )


def draft_ratio_warning(ratio: float) -> str | None:
    lo, hi = DRAFT_RATIO_BAND
    if ratio >= 0.5:
        return (
            f"draft has {ratio:.0%} of the target's parameters: a draft this large saves little or "
            "nothing per accepted token (the demo pair is one model in two quantisations; it "
            f"demonstrates exact speculation, not speed). A useful separate draft is {lo:.0%}-{hi:.0%}."
        )
    if ratio > hi:
        return f"draft/target parameter ratio {ratio:.1%} is above the useful {lo:.0%}-{hi:.0%}: drafting costs too much"
    if ratio < lo:
        return f"draft/target parameter ratio {ratio:.1%} is below the useful {lo:.0%}-{hi:.0%}: expect low acceptance"
    return None


def plan_memory(
    target: ModelFacts,
    draft: ModelFacts | None,
    *,
    n_ctx: int,
    parallel: int = 1,
    kv_type: str = "f16",
    n_ubatch: int = 512,
    n_outputs: int = 64,
    flash_attn: bool = False,
    gpu: bool = True,
) -> MemoryPlan:
    """Bytes for target + draft with `parallel` slots of `n_ctx` positions each, in one shared
    context per model. A draft whose architecture is `eagle3` is a head: its weights (the
    target's token embeddings are shared, not in its GGUF), its KV over the target's n_ctx,
    every row of its forwards an output (logits over the target's vocabulary and its pre-norm
    state), and the target's forwards also output three layers' inputs per token."""
    if kv_type not in KV_BYTES:
        raise ConfigError("kv_type", f"must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
    if n_ctx < 1:
        raise ConfigError("n_ctx", f"must be >= 1, got {n_ctx}")
    if parallel < 1:
        raise ConfigError("parallel", f"must be >= 1, got {parallel}")
    common: dict[str, Any] = dict(n_ctx=n_ctx, parallel=parallel, kv_type=kv_type, n_ubatch=n_ubatch, n_outputs=n_outputs, flash_attn=flash_attn)
    warnings: list[str] = []
    ratio = None
    if draft is not None:
        ratio = draft.n_params / target.n_params if target.n_params else None
        message = draft_ratio_warning(ratio) if ratio is not None and draft.arch != "eagle3" else None
        if message:
            warnings.append(message)
        if draft.n_vocab != target.n_vocab:
            warnings.append(f"draft vocabulary ({draft.n_vocab}) differs from the target's ({target.n_vocab})")
    for facts in (target, draft):
        if facts is not None and facts.n_ctx_train and n_ctx > facts.n_ctx_train:
            warnings.append(f"n_ctx {n_ctx} exceeds {Path(facts.path).name}'s training context {facts.n_ctx_train}")
    if kv_type in ("q8_0", "q4_0") and not flash_attn:
        warnings.append(f"llama.cpp needs flash attention for a quantised V cache ({kv_type})")
    target_plan = _model_plan("target", target, **common)
    draft_plan = None if draft is None else _model_plan("draft", draft, **common)
    if draft is not None and draft.arch == "eagle3":
        target_plan = replace(target_plan, output_bytes=target_plan.output_bytes + 4 * 3 * target.n_embd * n_ubatch)
        draft_plan = _model_plan("head", draft, **dict(common, n_outputs=n_ubatch))
        draft_plan = replace(draft_plan, output_bytes=draft_plan.output_bytes + 4 * draft.n_embd * n_ubatch)
    return MemoryPlan(
        target=target_plan,
        draft=draft_plan,
        n_ctx=n_ctx,
        parallel=parallel,
        kv_type=kv_type,
        n_ubatch=n_ubatch,
        flash_attn=flash_attn,
        overhead_bytes=CUDA_CONTEXT_BYTES if gpu else 0,
        draft_ratio=ratio,
        warnings=tuple(warnings),
    )


def with_head(plan: MemoryPlan, head: ModelFacts) -> MemoryPlan:
    """`plan` with an EAGLE-3 head beside its draft model: the head's context as plan_memory counts
    a head drafting alone, and the target's forwards outputting three layers' inputs per token."""
    common: dict[str, Any] = dict(n_ctx=plan.n_ctx, parallel=plan.parallel, kv_type=plan.kv_type, n_ubatch=plan.n_ubatch,
                  flash_attn=plan.flash_attn)
    h = _model_plan("head", head, **dict(common, n_outputs=plan.n_ubatch))
    h = replace(h, output_bytes=h.output_bytes + 4 * head.n_embd * plan.n_ubatch)
    t = plan.target
    target = replace(t, output_bytes=t.output_bytes + 4 * 3 * t.facts.n_embd * plan.n_ubatch)
    return replace(plan, target=target, head=h)


def embedding_plan(facts: ModelFacts, *, shared: bool, n_ctx: int, n_batch: int, flash_attn: bool = True,
                   n_seq_max: int = 16) -> ModelPlan:
    """The embedding context (edgespec.backend.EmbeddingContext): its own f16 cache of n_ctx cells,
    one vector of n_embd per token as output, no logits; its weights counted only when they are
    not the target's (`shared`)."""
    cells = -(-n_ctx // KV_PAD) * KV_PAD
    attn = 0 if flash_attn else facts.n_head * cells
    return ModelPlan(
        role="embedding", facts=facts, weights_bytes=0 if shared else facts.weights_bytes,
        kv_bytes=math.ceil(cells * facts.kv_bytes_per_cell("f16")),
        compute_bytes=4 * n_batch * (max(facts.n_embd, attn) + facts.n_ff + facts.n_embd),
        output_bytes=4 * facts.n_embd * (n_batch + n_seq_max))


# rows of logits one query-likelihood rerank forward reads at most (a row per query token)
QUERY_LIKELIHOOD_ROWS = 256


def rerank_plan(facts: ModelFacts, *, shared: bool, n_ctx: int, n_batch: int, flash_attn: bool = True,
                n_seq_max: int = 64, kind: str = "") -> ModelPlan:
    """The rerank context (edgespec.backend.RankContext): as an embedding context, plus rows of
    logits: one per document of a forward (causal-yes-no reads each document's last row), or one
    per query token, QUERY_LIKELIHOOD_ROWS at most (causal-query-likelihood)."""
    p = embedding_plan(facts, shared=shared, n_ctx=n_ctx, n_batch=n_batch, flash_attn=flash_attn,
                       n_seq_max=n_seq_max)
    rows = QUERY_LIKELIHOOD_ROWS if kind == "causal-query-likelihood" else n_seq_max
    return replace(p, role="rerank", output_bytes=p.output_bytes + 4 * facts.n_vocab * rows)


def plan_for_config(cfg: EngineConfig, *, gpu: bool | None = None, n_outputs: int = 64,
                    embedding: object = None, rerank: object = None) -> MemoryPlan:
    """The plan for the daemon's engine config (target/draft sections, parallel slots), and the
    [embedding] and [rerank] contexts when `embedding` / `rerank` (enabled sections) are given."""
    on_gpu = cfg.target.n_gpu_layers != 0 if gpu is None else gpu
    plan = _plan_for_engine(cfg, gpu=on_gpu, n_outputs=n_outputs)
    if not on_gpu:  # the caches' bounds come out of the same memory as the models
        plan = replace(plan, cache_bytes=(cfg.prompt_cache_bytes if cfg.prompt_cache else 0)
                       + (cfg.suffix_cache_bytes if cfg.suffix_cache else 0))
    if cfg.head is not None:
        plan = with_head(plan, read_model_facts(cfg.head.path))
    for section, make in (("embedding", embedding_plan), ("rerank", rerank_plan)):
        sec: Any = embedding if section == "embedding" else rerank
        if sec is None or not getattr(sec, "enabled", False):
            continue
        path = getattr(sec, "path", "") or cfg.target.path
        facts = plan.target.facts if path == cfg.target.path else read_model_facts(path)
        part = make(facts, shared=path == cfg.target.path, n_ctx=sec.n_ctx, n_batch=sec.n_batch,
                    flash_attn=cfg.target.flash_attn, **({"kind": sec.kind} if section == "rerank" else {}))
        plan = replace(plan, embedding=part) if section == "embedding" else replace(plan, rerank=part)
    return plan


def _plan_for_engine(cfg: EngineConfig, *, gpu: bool | None, n_outputs: int) -> MemoryPlan:
    target = read_model_facts(cfg.target.path)
    draft = read_model_facts(cfg.draft.path) if cfg.draft is not None else None
    on_gpu = cfg.target.n_gpu_layers != 0 if gpu is None else gpu
    return plan_memory(
        target,
        draft,
        n_ctx=cfg.target.n_ctx,
        parallel=cfg.parallel,
        kv_type=cfg.target.kv_type,
        n_ubatch=cfg.target.n_batch,
        n_outputs=n_outputs,
        flash_attn=cfg.target.flash_attn,
        gpu=on_gpu,
    )


# --- verdicts ---------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def explain(plan: MemoryPlan, device_bytes: int, headroom: float = DEFAULT_HEADROOM, device: str = "device") -> str:
    """One paragraph: what needs how much, and whether it fits."""
    parts = []
    for m in plan.models:
        parts.append(
            f"{m.role} {fmt_bytes(m.weights_bytes)} weights + {plan.parallel} x "
            f"({fmt_bytes(m.kv_bytes)} KV + {fmt_bytes(m.compute_bytes + m.output_bytes)} compute)"
        )
    need = plan.required_bytes(headroom)
    verdict = "fits" if need <= device_bytes else "does NOT fit"
    text = (
        f"{verdict}: needs {fmt_bytes(plan.total_bytes)} ({'; '.join(parts)}"
        + (f"; runtime {fmt_bytes(plan.overhead_bytes)}" if plan.overhead_bytes else "")
        + (f"; caches {fmt_bytes(plan.cache_bytes)}" if plan.cache_bytes else "")
        + f"), {fmt_bytes(need)} with {headroom:.0%} headroom, {device} has {fmt_bytes(device_bytes)}"
    )
    if need > device_bytes:
        text += (
            f"; short by {fmt_bytes(need - device_bytes)}: lower n_ctx or parallel, use kv_type q8_0/q4_0 "
            "with flash_attn, a smaller quantisation, or smaller server.prompt_cache_bytes and "
            "speculation.suffix_cache_bytes"
        )
    return text


def check_fits(plan: MemoryPlan, device_bytes: int, headroom: float = DEFAULT_HEADROOM, device: str = "device") -> None:
    """Raise ConfigError (key "engine") with the full explanation when the plan does not fit."""
    if not plan.fits(device_bytes, headroom):
        raise ConfigError("engine", explain(plan, device_bytes, headroom, device))


def system_memory_bytes() -> int:
    """Physical RAM (sysconf; works under ProcSubset=pid, unlike /proc/meminfo)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --- comparison with llama.cpp ----------------------------------------------------------------

_LOG_PATTERNS = {
    "weights_bytes": re.compile(r"model buffer size\s*=\s*([\d.]+) MiB"),
    "kv_bytes": re.compile(r"KV buffer size\s*=\s*([\d.]+) MiB"),
    "compute_bytes": re.compile(r"compute buffer size\s*=\s*([\d.]+) MiB"),
}


def parse_llama_log(text: str) -> dict[str, int]:
    """Sum the buffer sizes llama.cpp logs at load (all backends: CPU, CUDA0, CUDA_Host, ...).

    Keys: weights_bytes, kv_bytes, compute_bytes (absent when not logged).
    """
    out = {}
    for key, pattern in _LOG_PATTERNS.items():
        values = [float(v) for v in pattern.findall(text)]
        if values:
            out[key] = round(sum(values) * MIB)
    return out


@dataclass(frozen=True)
class Comparison:
    item: str
    estimated: int
    reported: int

    @property
    def rel_error(self) -> float:
        return (self.estimated - self.reported) / self.reported if self.reported else math.inf

    def as_dict(self) -> dict:
        return {**asdict(self), "rel_error": self.rel_error}


def compare_with_reported(model: ModelPlan, **reported: int | None) -> list[Comparison]:
    """Estimate vs llama.cpp for one model: pass weights_bytes (llama_model_size), kv_bytes,
    compute_bytes (e.g. from parse_llama_log) for ONE context; missing values are skipped."""
    estimates = {"weights_bytes": model.weights_bytes, "kv_bytes": model.kv_bytes, "compute_bytes": model.compute_bytes}
    unknown = set(reported) - set(estimates)
    if unknown:
        raise TypeError(f"unknown reported sizes: {sorted(unknown)}")
    return [Comparison(k, estimates[k], int(v)) for k, v in reported.items() if v is not None]
