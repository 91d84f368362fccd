"""`edgespec bench`: run a prompt suite in several modes, interleaved, and write JSON / markdown /
PNG reports (optionally beside llama.cpp's own binaries, see tools/llama-anchor.sh).

`python -m edgespec.cli.bench ...` runs the same command alone, without the other command groups
(whose imports, grpc and the generated protobuf modules, a bare GPU machine may lack)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import typer

from edgespec.cli.common import user_errors

if TYPE_CHECKING:
    from edgespec.config import EngineConfig
    from edgespec.sampling import SamplingParams

ANCHOR_FIELDS = ("id", "category", "mode", "tokens", "seconds", "tokens_per_second")
LLAMA_PREFIX = "llama.cpp:"  # the anchor's modes in the bench's rotation
DEFAULT_N_CTX = 2048


def _model_path(given: str | None, which: str) -> str:
    if given:
        return given
    from edgespec.models import default_pair  # the demo pair: F32 target, Q8_0 draft

    return str(getattr(default_pair(), which))


def bench(
    suite: str = typer.Option("structured", help="shipped suite (code, json, legal, rag, chat, chinese, drift, long, "
                              "structured, all) or a JSONL file"),
    modes: str = typer.Option("plain,chain,tree,auto", help="comma-separated modes, run interleaved per prompt"),
    max_tokens: int = typer.Option(128, "--max-tokens", help="tokens generated per prompt and mode"),
    target: str | None = typer.Option(None, help="target GGUF (default: the demo F32 target)"),
    draft: str | None = typer.Option(None, help="draft GGUF (default: the demo Q8_0 draft; 'none' = n-gram only; "
                                        "an EAGLE-3 head GGUF is detected and drafts as a head)"),
    head: str | None = typer.Option(None, help="also an EAGLE-3 head GGUF on a second engine: its modes run as "
                                       "head:chain, head:tree, head:auto (those of --modes), interleaved with the "
                                       "others prompt by prompt"),
    n_gpu_layers: int = typer.Option(0, "--n-gpu-layers", help="-1 = all layers on the GPU (CUDA build; "
                                     "a CPU build ignores it)"),
    threads: int = typer.Option(0, help="CPU threads (0 = all cores)"),
    flash_attn: bool = typer.Option(True, "--flash-attn/--no-flash-attn", help="flash attention in both models "
                                    "(off for a CUDA build without its flash-attention kernels, GGML_CUDA_FA=OFF)"),
    n_ctx: int | None = typer.Option(None, "--n-ctx", help="context size of each model (default: 2048, or "
                                        "what the suite's longest prompt + --max-tokens needs)"),
    limit: int | None = typer.Option(None, help="use only the first N prompts of each suite file"),
    json_out: Path | None = typer.Option(None, "--json", help="write the JSON report here"),
    markdown_out: Path | None = typer.Option(None, "--markdown", help="write the markdown table here"),
    plot_out: Path | None = typer.Option(None, "--plot", help="write the PNG plot here"),
    anchor: Path | None = typer.Option(None, help="merge llama.cpp anchor results (tools/llama-anchor.sh --json)"),
    anchor_bin: Path | None = typer.Option(None, "--anchor-bin", help="run llama.cpp's own llama-completion and "
                                              "llama-speculative-simple from this directory (tools/llama-anchor.sh "
                                              "build) inside the interleaved loop, prompt by prompt"),
    anchor_draft_max: int = typer.Option(4, "--anchor-draft-max", help="llama-speculative-simple --spec-draft-n-max"),
    anchor_draft: str | None = typer.Option(None, "--anchor-draft", help="draft GGUF for llama.cpp's speculation "
                                               "(default: edgespec's draft)"),
    structured: str | None = typer.Option(None, help="comma-separated categories the headline pools as "
                                             "structured (default: by name: code, json, legal, rag, extract..., sql...)"),
    drift: str | None = typer.Option(None, help="comma-separated categories the headline pools as drift "
                                        "(default: by name: drift, ood, out-of-domain, random...)"),
    temperature: float = typer.Option(0.0, help="0 = greedy; > 0 samples (every mode the same seed per prompt)"),
    top_k: int = typer.Option(0, "--top-k", help="with --temperature: 0 = off"),
    top_p: float = typer.Option(1.0, "--top-p", help="with --temperature: in (0, 1]"),
    min_p: float = typer.Option(0.0, "--min-p", help="with --temperature: in [0, 1)"),
    seed: int = typer.Option(0, help="with --temperature: prompt i samples with seed + i"),
    progress: bool = typer.Option(True, help="progress bar on stderr"),
    warmup: bool = typer.Option(True, help="one unrecorded warm-up generation per mode first"),
) -> None:
    """Benchmark edgespec's modes on a prompt suite (greedy unless --temperature; interleaved, same engine)."""
    with user_errors():
        _bench(SimpleNamespace(**locals()))


def _bench(a: SimpleNamespace) -> None:
    """`edgespec bench` with its options `a`: check them, run the suite, write the reports."""
    from edgespec.bench import report as rep
    from edgespec.bench.runner import base_mode, parse_modes
    from edgespec.bench.suite import load_suite

    mode_list = parse_modes(a.modes)
    if a.head is not None:  # the head's modes, on its own engine (runner: NAME:MODE)
        mode_list += tuple(f"head:{m}" for m in mode_list if base_mode(m) != "plain")
    sampling = _sampling(a)
    prompts = load_suite(a.suite, limit=a.limit)
    groups = {name: _categories(name, given, prompts) for name, given in (("structured", a.structured), ("drift", a.drift))}
    _check_anchor(a)
    anchor_data = _read_anchor(a.anchor) if a.anchor else None
    target_path = _model_path(a.target, "target")
    draft_path = None if a.draft == "none" else _model_path(a.draft, "draft")
    for p in (target_path, draft_path, a.head):
        if p is not None and not Path(p).is_file():
            raise FileNotFoundError(2, "model not found (run `edgespec models prepare-demo`)", p)
    llama_draft = _llama_draft(a, draft_path)
    rows, cfg, backend, costs, live = _run_suite(a, prompts, mode_list, sampling, target_path, draft_path, llama_draft)
    if live is not None:
        anchor_data = live
    settings = {
        "suite": a.suite, "modes": list(mode_list), "max_tokens": a.max_tokens, "target": target_path,
        "draft": draft_path, **({} if a.head is None else {"head": a.head}), "n_gpu_layers": a.n_gpu_layers, "threads": cfg.target.n_threads,
        "n_ctx": cfg.target.n_ctx, "temperature": a.temperature,
        **({} if sampling.greedy else {"top_k": a.top_k, "top_p": a.top_p, "min_p": a.min_p, "seed": a.seed}),
        "prompts": len(prompts),
    }
    report = rep.build_report(rows, command=_command_line(), machine=rep.machine_info(backend), settings=settings,
                              anchor=anchor_data, costs=costs, structured=groups["structured"], drift=groups["drift"])
    markdown = rep.to_markdown(report)
    rep.write_outputs(report, markdown, json_out=a.json_out, markdown_out=a.markdown_out, plot_out=a.plot_out,
                      plot=_plot)
    typer.echo(markdown)


def _plot(report: dict, path: str) -> None:
    from edgespec.bench.plot import plot  # matplotlib: only when a plot is asked for

    plot(report, path)


def _sampling(a: SimpleNamespace) -> SamplingParams:
    """The sampling options checked (with the numbers and anchor options that depend on them)."""
    from edgespec.errors import BadRequest
    from edgespec.sampling import SamplingParams

    sampling = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=a.seed)
    if sampling.greedy and (a.top_k, a.top_p, a.min_p) != (0, 1.0, 0.0):
        raise BadRequest("temperature", "top_k / top_p / min_p need a temperature > 0 (0 = greedy)")
    if not sampling.greedy and (a.anchor_bin or a.anchor):
        raise BadRequest("anchor_bin" if a.anchor_bin else "anchor",
                         "llama.cpp's anchor runs are greedy: compare them with a greedy bench (no --temperature)")
    if a.max_tokens < 1:
        raise BadRequest("max_tokens", f"must be >= 1, got {a.max_tokens}")
    if a.limit is not None and a.limit < 1:
        raise BadRequest("limit", f"must be >= 1, got {a.limit}")
    return sampling


def _check_anchor(a: SimpleNamespace) -> None:
    from edgespec.errors import BadRequest

    if a.anchor_draft and not a.anchor_bin:
        raise BadRequest("anchor_draft", "only with --anchor-bin")
    if a.anchor and a.anchor_bin:
        raise BadRequest("anchor_bin", "give --anchor (a finished anchor run) or --anchor-bin (run it here), not both")
    if a.anchor_bin is not None and not a.anchor_bin.is_dir():
        raise BadRequest("anchor_bin", f"{a.anchor_bin}: not a directory (tools/llama-anchor.sh build prints it)")
    if not 1 <= a.anchor_draft_max <= 64:
        raise BadRequest("anchor_draft_max", f"must be in [1, 64], got {a.anchor_draft_max}")


def _llama_draft(a: SimpleNamespace, draft_path: str | None) -> str | None:
    """The draft llama.cpp's speculation runs with (None: no --anchor-bin)."""
    from edgespec.errors import BadRequest

    if a.anchor_bin is None:
        return None
    llama_draft = a.anchor_draft or draft_path
    if llama_draft is None:
        raise BadRequest("anchor_bin", "llama.cpp's speculation needs a draft model (not --draft none)")
    if not Path(llama_draft).is_file():
        raise BadRequest("anchor_draft", f"{llama_draft}: model not found")
    return llama_draft


def _run_suite(a: SimpleNamespace, prompts, mode_list, sampling, target_path: str, draft_path: str | None,
               llama_draft: str | None):
    """Load the engine (with the context the suite needs), run it: (rows, engine config, backend,
    measured costs, the interleaved anchor's report or None)."""
    from edgespec.bench.runner import bench_engine_config, context_needed, run
    from edgespec.engine import Engine
    from edgespec.errors import BadRequest

    def config(ctx: int) -> EngineConfig:
        return bench_engine_config(target_path, draft_path, n_ctx=ctx, n_gpu_layers=a.n_gpu_layers, threads=a.threads,
                                   flash_attn=a.flash_attn)

    cfg = config(DEFAULT_N_CTX if a.n_ctx is None else a.n_ctx)
    engine = Engine.load(cfg)
    others: dict = {}  # engines of other drafts on the same target (--head)
    try:
        # a suite with long prompts (RAG contexts) gets the context it needs, unless --n-ctx
        # says otherwise: then it is an error before any run, naming the prompt
        need, pid = context_needed(engine, prompts, a.max_tokens)
        if need > engine.n_ctx:
            if a.n_ctx is not None:
                raise BadRequest("n_ctx", f"prompt {pid!r} needs a context of {need} tokens (prompt + "
                                          f"--max-tokens {a.max_tokens} + speculation headroom); got {a.n_ctx}")
            small, engine = engine, None
            small.close()
            cfg = config(-(-need // 256) * 256)
            engine = Engine.load(cfg)
        if a.head is not None:
            others["head"] = head = Engine.load(bench_engine_config(
                target_path, a.head, n_ctx=cfg.target.n_ctx, n_gpu_layers=a.n_gpu_layers, threads=a.threads,
                flash_attn=a.flash_attn))
            if head.draft_kind != "eagle3":
                raise BadRequest("head", f"{a.head} is not an EAGLE-3 head (a draft model goes in --draft)")
        external, live = None, None
        ext_rows: list[dict] = []
        if a.anchor_bin is not None:
            from edgespec.bench.anchor import interleaved_runners

            live = interleaved_runners(a.anchor_bin, target=target_path, draft=llama_draft, max_tokens=a.max_tokens,
                                       threads=cfg.target.n_threads, n_ctx=cfg.target.n_ctx,
                                       n_gpu_layers=a.n_gpu_layers, draft_max=a.anchor_draft_max)
            external = {LLAMA_PREFIX + m: fn for m, fn in live["runners"].items()}
        backend = (engine.model_info() or {}).get("backend")
        rows = run(engine, prompts, mode_list, a.max_tokens, warmup=a.warmup, progress=a.progress,
                   external=external, external_rows=ext_rows, sampling=None if sampling.greedy else sampling,
                   others=others)
        costs = engine.cost.as_dict()
    finally:
        if engine is not None:
            engine.close()
        for other in others.values():
            other.close()
    anchor = None if live is None else {
        "command": "(interleaved with this run) " + _command_line(),
        "settings": live["settings"],
        "example_commands": live["example_commands"],
        "results": [{**r, "mode": r["mode"][len(LLAMA_PREFIX):]} for r in ext_rows],
    }
    return rows, cfg, backend, costs, anchor


def _categories(field: str, given: str | None, prompts) -> list[str] | None:
    """--structured / --drift: a comma-separated list of the suite's categories (None: by name)."""
    if given is None:
        return None
    from edgespec.errors import BadRequest

    names = [c.strip() for c in given.split(",") if c.strip()]
    have = list(dict.fromkeys(p.category for p in prompts))
    unknown = [c for c in names if c not in have]
    if not names or unknown:
        raise BadRequest(field, f"no category {', '.join(map(repr, unknown)) or repr(given)} in the suite "
                                f"(it has: {', '.join(have)})")
    return names


def _command_line() -> str:
    """The command as a user would retype it (also when run as `python -m edgespec.cli.bench`)."""
    args = sys.argv[1:]
    if args[:1] == ["bench"]:
        args = args[1:]
    return "edgespec bench " + shlex.join(args)


def _read_anchor(path: Path) -> dict:
    from edgespec.errors import BadRequest

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise BadRequest("anchor", f"{path}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise BadRequest("anchor", f"{path}: expected an object with a 'results' list")
    for i, row in enumerate(data["results"]):
        missing = [k for k in ANCHOR_FIELDS if not isinstance(row, dict) or k not in row]
        if missing:
            raise BadRequest("anchor", f"{path}: results[{i}] lacks {', '.join(missing)}")
    return data


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)


if __name__ == "__main__":
    typer.run(bench)
