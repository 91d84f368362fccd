"""`edgespec config validate|show|defaults|reference|hash-token`."""

from __future__ import annotations

import getpass
import json
import sys
from dataclasses import asdict
from pathlib import Path

import typer

from edgespec.cli.common import user_errors

config_app = typer.Typer(help="Check and inspect daemon configuration.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")


@config_app.command("validate")
def validate(
    file: Path = typer.Argument(..., help="TOML config file."),
    check_models: bool = typer.Option(True, "--check-models/--no-check-models", help="Also require the model files."),
) -> None:
    """List every problem in FILE (with its key); exit 2 if there is any."""
    from edgespec.server.config import InvalidConfig, load

    try:
        load(file, check_models=check_models)
    except InvalidConfig as exc:
        typer.echo(f"{file}: {len(exc.problems)} problem(s)", err=True)
        for key, message in exc.problems:
            typer.echo(f"  {key}: {message}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{file}: ok")


@config_app.command("show")
def show(file: Path | None = typer.Argument(None, help="TOML config file (default: built-in defaults).")) -> None:
    """Print the effective configuration (file + environment) as JSON."""
    from edgespec.server.config import load

    with user_errors():
        cfg = load(file)
    typer.echo(json.dumps(asdict(cfg), indent=2, default=str))


@config_app.command("defaults")
def defaults() -> None:
    """Print every key with its default and documentation, as TOML."""
    from edgespec.server.config import documented_defaults

    typer.echo(documented_defaults())


@config_app.command("reference")
def reference() -> None:
    """Print the configuration reference (docs/configuration.md) as Markdown: every key with its
    type, default, range and meaning."""
    from edgespec.server.config import reference as markdown

    typer.echo(markdown(), nl=False)


@config_app.command("hash-token")
def hash_token(
    token: str | None = typer.Argument(None, help="The token (default: read from stdin / prompt)."),
    name: str | None = typer.Option(None, help="the caller's name the logs show for this token (name:hash)"),
) -> None:
    """Print the line to put in auth.tokens_file / auth.admin_tokens_file: the token's sha256, or
    name:sha256 with --name."""
    from edgespec.server.auth import hash_token as h
    from edgespec.server.auth import valid_name

    if name is not None and not valid_name(name):
        typer.echo(f"error: --name: 1-64 characters of [A-Za-z0-9-_.@], got {name!r}", err=True)
        raise typer.Exit(2)

    if token is None:
        token = getpass.getpass("token: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\n")
    if not token:
        typer.echo("error: empty token", err=True)
        raise typer.Exit(2)
    typer.echo(f"{name}:{h(token)}" if name else h(token))
