"""`edgespec plan`: will target + draft + KV caches + compute buffers fit the device?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from edgespec.cli.common import fail, user_errors


def _render(plan, device_bytes: int, device: str, headroom: float) -> str:
    from edgespec.plan import explain, fmt_bytes

    rows = [("", "params", "weights", "KV (all slots)", "compute", "total")]
    for m in plan.models:
        rows.append((
            m.role, f"{m.facts.n_params / 1e6:,.1f} M", fmt_bytes(m.weights_bytes), fmt_bytes(m.kv_bytes),
            fmt_bytes(m.compute_bytes + m.output_bytes), fmt_bytes(m.total()),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.append(
        f"n_ctx {plan.n_ctx} x {plan.parallel} slot(s), KV {plan.kv_type}, n_ubatch {plan.n_ubatch}, "
        f"flash_attn {'on' if plan.flash_attn else 'off'}"
    )
    if plan.draft_ratio is not None:
        lines.append(f"draft/target parameters: {plan.draft_ratio:.1%}")
    lines += [f"warning: {w}" for w in plan.warnings]
    lines.append(explain(plan, device_bytes, headroom, device))
    return "\n".join(lines)


def plan_cmd(
    target: Path | None = typer.Option(None, "--target", help="Target model GGUF (required but with --config)."),
    config: Path | None = typer.Option(None, "--config", help="Plan the daemon this config describes "
                                       "(every chat model with its slots and caches, the embedding and rerank "
                                       "contexts, the budget they share) instead of --target/--draft; with "
                                       "--systemd its unit's limits."),
    draft: Path | None = typer.Option(None, "--draft", help="Draft model GGUF (omit for n-gram drafting only)."),
    head: Path | None = typer.Option(None, "--head", help="An EAGLE-3 head GGUF loaded beside the draft model "
                                     "([draft] head)."),
    n_ctx: int = typer.Option(4096, "--n-ctx", help="Context cells per slot (each model)."),
    parallel: int = typer.Option(1, "--parallel", help="Slots decoded concurrently; each has its own KV caches. "
                                 "With --measure: streams decoding together (plain verifies N tokens a forward, "
                                 "chains N(k+1)): the ceiling at that load."),
    vram: float | None = typer.Option(None, "--vram", help="Device memory in GiB (default: the first GPU llama.cpp "
                                                  "lists, as the daemon's check, else RAM)."),
    kv_type: str = typer.Option("f16", "--kv-type", help="KV cache type: f16, q8_0, q4_0 (f32 also accepted)."),
    n_batch: int = typer.Option(512, "--n-batch", help="Micro-batch (n_ubatch) llama.cpp reserves compute for."),
    n_outputs: int = typer.Option(64, "--n-outputs", help="Logit rows per decode (tree nodes verified at once)."),
    flash_attn: bool = typer.Option(True, "--flash-attn/--no-flash-attn", help="Flash attention (no KQ buffer)."),
    cpu: bool = typer.Option(False, "--cpu", help="Plan for CPU inference (the RAM; no CUDA runtime "
                                                   "overhead)."),
    embedding: str = typer.Option("target", "--embedding", help="The embedding model: 'target' (its weights "
                                  "shared, a context of its own), a GGUF path, or 'none'."),
    embedding_n_ctx: int = typer.Option(2048, "--embedding-n-ctx", help="The embedding context's cells."),
    rerank: str = typer.Option("target", "--rerank", help="The rerank model: 'target' (its weights shared, "
                               "a context of its own), a GGUF path, or 'none'."),
    rerank_n_ctx: int = typer.Option(4096, "--rerank-n-ctx", help="The rerank context's cells."),
    headroom: float = typer.Option(0.05, "--headroom", help="Fraction of the device kept free."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    systemd: bool = typer.Option(False, "--systemd", help="Print a systemd drop-in for edgespec.service "
                                 "(MemoryHigh=, MemoryMax=) sized from this plan; the installer writes it."),
    measure: bool = typer.Option(False, "--measure", help="Instead of the memory plan: time the target's "
                                 "forwards of 1-64 tokens and the draft's one-token forward on this box, and "
                                 "print the break-even acceptance and the speedup a chain of each depth can "
                                 "make at acceptance 0.6, 0.7 and 0.8 (no --draft: model-free drafts, cost 0)."),
    context: int = typer.Option(256, "--context", help="--measure: tokens of context before the timed forwards."),
    rounds: int = typer.Option(5, "--rounds", help="--measure: rounds over all sizes (each figure a median)."),
    threads: int = typer.Option(0, "--threads", help="--measure: CPU threads (0: all cores)."),
    acceptance: str = typer.Option("0.6,0.7,0.8", "--acceptance", help="--measure: per-token acceptances to "
                                   "price, comma-separated (a draft's measured one, e.g. from `edgespec bench`)."),
    alternate: bool = typer.Option(False, "--alternate", help="--measure: time each forward right after a "
                                   "one-token forward (shapes alternate every call: on a GPU, CUDA graphs "
                                   "warm up again)."),
) -> None:
    """Memory plan from GGUF metadata; exit 0 if it fits, 1 if it does not. With --measure: will
    speculation pay on this box?"""

    if systemd and config is not None:
        _systemd_for_config(config)
        return
    if config is not None and target is None:
        _config_plan(config, headroom=headroom, as_json=as_json)
        return
    if target is None:
        fail("--target: required (or --config with --systemd)")
    if measure:
        if not 1 <= parallel <= 16:
            fail(f"--parallel: with --measure, streams from 1 to 16, got {parallel}")
        _measure(target, draft, context=context, rounds=rounds, threads=threads, gpu=not cpu, alternate=alternate,
                 acceptances=_acceptances(acceptance), as_json=as_json, streams=parallel, flash_attn=flash_attn)
        return

    _memory(target, draft, head, n_ctx=n_ctx, parallel=parallel, vram=vram, kv_type=kv_type, n_batch=n_batch,
            n_outputs=n_outputs, flash_attn=flash_attn, cpu=cpu, side=(embedding, embedding_n_ctx, rerank, rerank_n_ctx),
            headroom=headroom, as_json=as_json, systemd=systemd)

def _memory(target: Path, draft: Path | None, head: Path | None, *, n_ctx: int, parallel: int, vram: float | None,
            kv_type: str, n_batch: int, n_outputs: int, flash_attn: bool, cpu: bool,
            side: tuple[str, int, str, int], headroom: float, as_json: bool, systemd: bool = False) -> None:
    """The memory plan printed; exits 0 if it fits, 1 if not."""
    embedding, embedding_n_ctx, rerank, rerank_n_ctx = side
    from edgespec.plan import GIB, plan_memory, read_model_facts, with_head

    with user_errors():
        if not 0 <= headroom < 1:
            from edgespec.errors import BadRequest

            raise BadRequest("headroom", f"must be in [0, 1), got {headroom}")
        if vram is not None:
            device_bytes, device, gpu = int(vram * GIB), f"--vram {vram:g} GiB", not cpu
        else:  # the daemon's own probe: the GPU llama.cpp would offload to, else the RAM
            from edgespec.backend import device_memory

            device_bytes, device, gpu = device_memory(gpu=not cpu)
        plan = plan_memory(
            read_model_facts(target),
            read_model_facts(draft) if draft else None,
            n_ctx=n_ctx, parallel=parallel, kv_type=kv_type, n_ubatch=n_batch,
            n_outputs=n_outputs, flash_attn=flash_attn, gpu=gpu,
        )
        if head is not None:
            plan = with_head(plan, read_model_facts(head))
        plan = _with_side_models(plan, embedding, embedding_n_ctx, rerank, rerank_n_ctx, flash_attn)
        pairing = None
        if draft is not None:
            from edgespec.pairing import describe_pair

            pairing = describe_pair(target, draft)
    if systemd:
        from edgespec.plan import systemd_memory

        typer.echo(systemd_memory(plan), nl=False)
        raise typer.Exit(0)
    if as_json:
        extra = {} if pairing is None else {"pairing": pairing}
        typer.echo(json.dumps({**plan.as_dict(device_bytes, headroom), "device": device, **extra}, indent=2))
    else:
        typer.echo(_render(plan, device_bytes, device, headroom))
        if pairing is not None:
            typer.echo(f"pairing: {pairing}")
    raise typer.Exit(0 if plan.fits(device_bytes, headroom) else 1)


def _systemd_for_config(config: Path) -> None:
    """The unit's memory limits and address rules for the daemon `config` describes (with [[chat]]
    entries: as many of its chat models as the budget lets load at once)."""
    from edgespec.plan import plan_for_config, systemd_memory
    from edgespec.server.config import load, systemd_network

    with user_errors():
        cfg = load(config)
        plan = plan_for_config(cfg.engine, embedding=cfg.embedding, rerank=cfg.rerank)
        extra = 0
        if cfg.chat:
            models = _models_plan(cfg)
            extra = max(0, min(models.all_bytes, models.budget_bytes) - plan.total_bytes)
        typer.echo(systemd_memory(plan, extra_bytes=extra) + systemd_network(cfg), nl=False)


def _models_plan(cfg: Any) -> Any:
    from edgespec.server.chat_plan import models_plan

    entries = cfg.chat_entries()
    return models_plan(cfg.engine, entries[1:], cfg.models.memory_bytes, cfg.embedding, cfg.rerank,
                       default_name=entries[0].name)


def _config_plan(config: Path, *, headroom: float, as_json: bool) -> None:
    """The one memory plan of the daemon `config` describes: each chat model ([target] and every
    [[chat]] entry) with its KV cache and compute buffers, the embedding and rerank contexts, and
    the budget they share. Exit 0 if it can serve, 1 if not."""
    from edgespec.server.config import load

    with user_errors():
        cfg = load(config)
        models = _models_plan(cfg)
    problem = models.problem()
    if as_json:
        typer.echo(json.dumps({"chat": {name: {"load": load, **p.as_dict()} for name, p, load in models.chat},
                               "side_bytes": models.side_bytes, "all_bytes": models.all_bytes,
                               "at_start_bytes": models.at_start, "budget_bytes": models.budget_bytes,
                               "device": models.device, "fits": problem is None}, indent=2))
    else:
        for name, p, _ in models.chat:
            typer.echo(f"-- {name}")
            typer.echo(_render(p, models.budget_bytes, models.device, 0.0))
        for line in models.lines():
            typer.echo(line)
        if problem is not None:
            typer.echo(f"does NOT fit: {problem}")
    raise typer.Exit(0 if problem is None else 1)


def _with_side_models(plan: Any, embedding: str, embedding_n_ctx: int, rerank: str, rerank_n_ctx: int,
                      flash_attn: bool) -> Any:
    """The plan with the embedding and rerank contexts ('target': its weights shared; a path;
    'none')."""
    from dataclasses import replace

    from edgespec.plan import embedding_plan, read_model_facts, rerank_plan

    if embedding != "none":
        shared = embedding == "target"
        facts = plan.target.facts if shared else read_model_facts(embedding)
        plan = replace(plan, embedding=embedding_plan(facts, shared=shared, n_ctx=embedding_n_ctx,
                                                      n_batch=embedding_n_ctx, flash_attn=flash_attn))
    if rerank != "none":
        shared = rerank == "target"
        facts = plan.target.facts if shared else read_model_facts(rerank)
        plan = replace(plan, rerank=rerank_plan(facts, shared=shared, n_ctx=rerank_n_ctx,
                                                n_batch=min(rerank_n_ctx, 2048), flash_attn=flash_attn))
    return plan


def _acceptances(text: str) -> tuple[float, ...]:
    from edgespec.errors import BadRequest

    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or not all(0 <= a < 1 for a in out):
        raise typer.BadParameter(str(BadRequest("acceptance", f"comma-separated numbers in [0, 1), got {text!r}")))
    return out


def _measure(target: Path, draft: Path | None, *, context: int, rounds: int, threads: int, gpu: bool,
             alternate: bool, acceptances: tuple[float, ...], as_json: bool, streams: int = 1,
             flash_attn: bool = True) -> None:
    from edgespec.economics import economics, measure, render, stream_sizes

    with user_errors():
        from edgespec import backend

        n_gpu = -1 if gpu and backend.gpu_offload_supported() else 0
        log = (lambda s: None) if as_json else (lambda s: typer.echo(s, err=True))
        log(f"timing {target.name}" + (f" and {draft.name}" if draft else "") + f" ({rounds} rounds)")
        tables = measure([(target, stream_sizes(streams)), *([(draft, (streams,))] if draft else [])],
                         context=context, rounds=rounds, threads=threads or None, n_gpu_layers=n_gpu,
                         alternate=alternate, flash_attn=flash_attn, log=log)
        e = economics(tables[0], tables[1][streams] if draft else 0.0, acceptances, streams)
    if as_json:
        typer.echo(json.dumps({"target": str(target), "draft": str(draft) if draft else None,
                               "context": context, "rounds": rounds, "alternate": alternate, "n_gpu_layers": n_gpu,
                               "flash_attn": flash_attn,
                               **e.as_dict()}, indent=2))
    else:
        typer.echo(render(e, f"draft {draft.name}" if draft else "model-free drafts (cost taken as 0)"))


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)
