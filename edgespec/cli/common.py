"""Shared CLI helpers: one-line errors with exit code 2, never a traceback, for bad input."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import typer

from edgespec.errors import BadRequest, ConfigError, EdgespecError


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn domain errors into `error: ...` on stderr and exit code 2."""
    try:
        yield
    except (BadRequest, ConfigError, EdgespecError) as exc:
        fail(str(exc))
    except FileNotFoundError as exc:
        fail(f"file not found: {exc.filename or exc}")
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
