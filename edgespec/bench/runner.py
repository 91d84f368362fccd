"""The interleaved benchmark loop: one engine, every prompt run in every mode, the mode order
rotated prompt by prompt (A B C, B C A, C A B, ...) so slow machine drift hits all modes alike.

A mode `MODE+schema` (e.g. `auto+schema`) is MODE with each prompt's JSON schema as the request's
constraint (structured output); its rows record whether the answer parses and validates.

A mode `MODE+suffix` (e.g. `auto+suffix`) is MODE drafting from the engine's cross-request suffix
cache too (drafters/suffix.py); the other modes neither read nor feed it, so the cache holds what
the +suffix runs of the prompts before emitted: run in order, a suite is a stream of requests, and
the report's warm-up curve shows the speedup after 0, 10, 30 and 100 of them."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from edgespec import chat
from edgespec.bench.suite import Prompt
from edgespec.config import EngineConfig, ModelConfig
from edgespec.errors import BadRequest
from edgespec.sampling import SamplingParams
from edgespec.types import MODES, ConstraintSpec, GenerationRequest, GenerationResult, SpeculationParams

SCHEMA_SUFFIX = "+schema"
CACHE_SUFFIX = "+suffix"


class BenchEngine(Protocol):
    """The part of `edgespec.engine.Engine` the bench uses (a fake stands in for it in tests)."""

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]: ...
    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> str: ...
    def generate(self, req: GenerationRequest) -> GenerationResult: ...


@dataclass(frozen=True)
class Row:
    id: str
    category: str
    mode: str
    tokens: int
    seconds: float
    tokens_per_second: float
    tau: float
    target_forwards: int
    # where the time went (absent from llama.cpp anchor rows): forwards of the draft model, seconds
    # inside the target's and the draft's llama_decode, and steps that accepted >= d + 1 drafts
    draft_forwards: int = 0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    accepted_per_depth: tuple[int, ...] = ()
    valid: bool | None = None  # MODE+schema rows: the answer parses as JSON and follows the schema
    index: int = -1  # the prompt's place in the stream (0 = first)
    # draft tokens verified / accepted per source (draft, head, prompt_lookup, suffix, forced)
    proposed_by_source: tuple[tuple[str, int], ...] = ()
    accepted_by_source: tuple[tuple[str, int], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["accepted_per_depth"] = list(self.accepted_per_depth)
        d["proposed_by_source"] = dict(self.proposed_by_source)
        d["accepted_by_source"] = dict(self.accepted_by_source)
        return d


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    if not modes:
        raise BadRequest("modes", f"give at least one of {', '.join(MODES)}")
    for m in modes:
        if base_mode(m) not in MODES:
            raise BadRequest("modes", f"must be among {', '.join(MODES)} (each optionally +schema and/or "
                                      f"+suffix), got {m!r}")
    if len(set(modes)) != len(modes):
        raise BadRequest("modes", f"duplicate mode in {text!r}")
    return modes


def base_mode(mode: str) -> str:
    """The engine's mode of a bench mode: `auto+schema` -> `auto`, `auto+suffix` -> `auto`."""
    return mode.removesuffix(CACHE_SUFFIX).removesuffix(SCHEMA_SUFFIX)


def constraint_of(prompt: Prompt, mode: str) -> ConstraintSpec | None:
    """The constraint a bench mode puts on a prompt: its schema for MODE+schema, else none."""
    if not mode.removesuffix(CACHE_SUFFIX).endswith(SCHEMA_SUFFIX):
        return None
    if prompt.schema is None:
        raise BadRequest("modes", f"{mode} needs a schema on every prompt; {prompt.id} has none "
                         "(the shipped json suite has them)")
    return ConstraintSpec("json_schema", prompt.schema)


def schema_valid(text: str, schema: str) -> bool:
    """The answer parses as JSON and validates against the schema (jsonschema when installed,
    else parsing only)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return True
    try:
        jsonschema.validate(value, json.loads(schema))
    except jsonschema.ValidationError:
        return False
    return True


def mode_order(modes: Sequence[str], index: int) -> list[str]:
    """The modes rotated left by `index`: prompt 0 runs A B C, prompt 1 B C A, ..."""
    k = index % len(modes)
    return list(modes[k:]) + list(modes[:k])


def prompt_tokens(engine: BenchEngine, prompt: Prompt) -> tuple[int, ...]:
    """The user prompt in the target's chat template, tokenized as llama.cpp's tools do
    (add_special, parse_special), so the anchor binaries see the same tokens."""
    return tuple(chat.template_tokens(engine, [("user", prompt.prompt)]))


def prompt_text(engine: BenchEngine, prompt: Prompt) -> str:
    """The user prompt in the target's chat template (what llama.cpp's binaries are given)."""
    return engine.chat_prompt([("user", prompt.prompt)])


def context_needed(engine: BenchEngine, prompts: Sequence[Prompt], max_tokens: int) -> tuple[int, str]:
    """(context size the longest prompt needs, its id): its tokens + max_tokens + the engine's
    speculation headroom (Engine.open_session's budget)."""
    headroom = SpeculationParams().context_headroom
    need, pid = 0, ""
    for p in prompts:
        n = len(prompt_tokens(engine, p)) + max_tokens + headroom
        if n > need:
            need, pid = n, p.id
    return need, pid


def request(tokens: tuple[int, ...], mode: str, max_tokens: int,
            sampling: SamplingParams | None = None, constraint: ConstraintSpec | None = None) -> GenerationRequest:
    """Greedy unless `sampling` is given (its max_tokens is replaced by `max_tokens`)."""
    sampling = SamplingParams(temperature=0.0) if sampling is None else sampling
    return GenerationRequest(
        prompt_tokens=tokens,
        sampling=replace(sampling, max_tokens=max_tokens),
        speculation=SpeculationParams(mode=base_mode(mode), suffix=mode.endswith(CACHE_SUFFIX)),  # type: ignore[arg-type]
        constraint=constraint,
    )


def prompt_sampling(sampling: SamplingParams | None, index: int) -> SamplingParams | None:
    """The sampling of the index-th prompt: every mode gets the same seed for a prompt, each prompt
    its own (the bench's --seed + index)."""
    if sampling is None or sampling.greedy:
        return None
    return replace(sampling, seed=((sampling.seed or 0) + index) % (2**63))


def run_one(engine: BenchEngine, prompt: Prompt, tokens: tuple[int, ...], mode: str, max_tokens: int,
            sampling: SamplingParams | None = None) -> Row:
    constraint = constraint_of(prompt, mode)
    result = engine.generate(request(tokens, mode, max_tokens, sampling, constraint))
    stats = result.stats
    return Row(
        id=prompt.id,
        category=prompt.category,
        mode=mode,
        tokens=stats.emitted_tokens,
        seconds=round(stats.seconds, 6),
        tokens_per_second=round(stats.tokens_per_second, 3),
        tau=round(stats.tau, 4),
        target_forwards=stats.target_forwards,
        draft_forwards=stats.draft_forwards,
        target_seconds=round(stats.target_seconds, 6),
        draft_seconds=round(stats.draft_seconds, 6),
        accepted_per_depth=tuple(stats.accepted_per_depth),
        valid=None if constraint is None else schema_valid(result.text, constraint.value),
        proposed_by_source=tuple(sorted(stats.proposed_by_source.items())),
        accepted_by_source=tuple(sorted(stats.accepted_by_source.items())),
    )


# an external runner (the llama.cpp anchor): prompt, its chat text -> {"tokens", "seconds", ...}
External = Callable[[Prompt, str], dict[str, Any]]


def run(
    engine: BenchEngine,
    prompts: Sequence[Prompt],
    modes: Sequence[str],
    max_tokens: int,
    *,
    warmup: bool = True,
    progress: bool = True,
    on_row: Callable[[Row], None] | None = None,
    external: dict[str, External] | None = None,
    external_rows: list[dict[str, Any]] | None = None,
    sampling: SamplingParams | None = None,
    others: dict[str, BenchEngine] | None = None,
) -> list[Row]:
    """Every prompt in every mode, interleaved. A warm-up generation (first prompt, every mode,
    a few tokens) runs first and is not recorded. `external` adds modes run by something else
    (llama.cpp's binaries) into the same rotation, so the machine's drift hits them alike; their
    rows go to `external_rows` as dicts with "mode" = the external mode's name. `others`: more
    engines (another draft on the same target): a mode "NAME:MODE" runs MODE on others[NAME], in
    the same rotation, its rows named so. `sampling`: sample instead of greedy decoding
    (`prompt_sampling`: one seed per prompt, the same in every mode)."""
    if max_tokens < 1:
        raise BadRequest("max_tokens", f"must be >= 1, got {max_tokens}")
    others = others or {}

    def engine_of(mode: str) -> tuple[BenchEngine, str]:
        name, _, base = mode.rpartition(":")
        if not name:
            return engine, mode
        if name not in others:
            raise BadRequest("modes", f"{mode!r} names no engine (known: {', '.join(sorted(others)) or 'none'})")
        return others[name], base

    if warmup and prompts:
        tokens = prompt_tokens(engine, prompts[0])
        for mode in modes:
            eng, base = engine_of(mode)
            eng.generate(request(tokens, base.removesuffix(CACHE_SUFFIX), min(8, max_tokens),
                                 prompt_sampling(sampling, 0), constraint_of(prompts[0], base)))

    external = external or {}
    all_modes = list(modes) + [m for m in external if m not in modes]
    bar = _progress_bar(len(prompts) * len(all_modes), enabled=progress)
    rows: list[Row] = []
    try:
        for i, prompt in enumerate(prompts):
            text = prompt_text(engine, prompt)
            tokens = prompt_tokens(engine, prompt)
            for mode in mode_order(all_modes, i):
                if mode in external:
                    got = external[mode](prompt, text)
                    ext = {"id": prompt.id, "category": prompt.category, "mode": mode, **got}
                    if external_rows is not None:
                        external_rows.append(ext)
                    if bar is not None:
                        bar.set_postfix_str(f"{prompt.id} {mode} {ext.get('tokens_per_second', 0):.1f} tok/s")
                        bar.update(1)
                    continue
                eng, base = engine_of(mode)
                row = replace(run_one(eng, prompt, tokens, base, max_tokens, prompt_sampling(sampling, i)), mode=mode,
                              index=i)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                if bar is not None:
                    bar.set_postfix_str(f"{prompt.id} {mode} {row.tokens_per_second:.1f} tok/s tau {row.tau:.2f}")
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return rows


def _progress_bar(total: int, *, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="run", file=sys.stderr, dynamic_ncols=True)


def bench_engine_config(target: str, draft: str | None, *, n_ctx: int, n_gpu_layers: int, threads: int,
                        flash_attn: bool = True) -> EngineConfig:
    """The bench's engine: every request starts cold (no prompt cache). The modes run one prompt
    after another on one slot, so a kept cache would hand each later mode the prompt the earlier
    one had absorbed: the draft's prefill, which a cold request pays, would vanish from their
    times. What the cache saves is measured apart (README, "Prompt cache"). `flash_attn`: off for
    a CUDA build without its flash-attention kernels (GGML_CUDA_FA=OFF)."""
    def model(path: str) -> ModelConfig:
        return ModelConfig(path=path, n_gpu_layers=n_gpu_layers, n_ctx=n_ctx, threads=threads, flash_attn=flash_attn)

    cfg = EngineConfig(target=model(target), draft=model(draft) if draft else None, prompt_cache=False)
    cfg.validate()
    return cfg
