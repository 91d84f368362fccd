"""Shared CLI helpers: one-line errors with exit code 2, never a traceback, for bad input."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

import typer

from edgespec.errors import BadRequest, ConfigError, EdgespecError


def fail(message: str, code: int = 2) -> NoReturn:
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


def engine_config(target: str | None, draft: str | None, *, n_ctx: int | None = None, n_gpu_layers: int | None = None,
                  threads: int | None = None, no_draft: bool = False, parallel: int = 1):
    """EngineConfig for the CLI: the demo pair unless paths are given; missing files are a user
    error naming the file. The demo draft drafts for the demo target alone: another target with no
    `draft` (or draft "none") gets none (model-free drafting). Unset model options take the
    [target] declaration's defaults."""
    from pathlib import Path

    from edgespec.config import EngineConfig, ModelConfig
    from edgespec.models import default_pair

    pair = default_pair()
    t = Path(target) if target else pair.target
    if no_draft or draft == "none" or (not draft and target and t.name != pair.target.name):
        d = None
    else:
        d = Path(draft) if draft else pair.draft
    for what, p in (("--target", t), ("--draft", d)):
        if p is not None and not p.is_file():
            hint = " (run `edgespec models prepare-demo`)" if not (target if what == "--target" else draft) else ""
            raise BadRequest(what, f"model file not found: {p}{hint}")
    given: dict[str, Any] = {k: v for k, v in (("n_ctx", n_ctx), ("n_gpu_layers", n_gpu_layers), ("threads", threads)) if v is not None}
    mk = lambda p: ModelConfig(path=str(p), **given)
    cfg = EngineConfig(target=mk(t), draft=mk(d) if d is not None else None, parallel=parallel)
    cfg.validate()
    return cfg
