"""The `edgespec` command. Each command group lives in its own module with a `register(app)`;
commands stay thin over library functions and import heavy modules (llama_cpp, grpc) lazily."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="edgespec",
    help="Exact speculative decoding appliance on llama.cpp.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    pretty_exceptions_enable=False,
)

# module -> registers its commands on `app`
_COMMAND_MODULES = (
    "edgespec.cli.generate",  # generate
    "edgespec.cli.models",  # models add | list | verify | prepare-demo | random-draft
    "edgespec.cli.selftest",  # selftest
    "edgespec.cli.serve",  # serve
    "edgespec.cli.client",  # client generate|stream, health, stats, policy, drain
    "edgespec.cli.config_cmd",  # config validate|show
    "edgespec.cli.plan",  # plan
    "edgespec.cli.bench",  # bench
    "edgespec.cli.bench_serve",  # bench-serve
    "edgespec.cli.bench_embed",  # bench-embed
    "edgespec.cli.bench_rerank",  # bench-rerank
)

for _name in _COMMAND_MODULES:
    importlib.import_module(_name).register(app)


@app.command("version")
def version() -> None:
    """Print the edgespec version."""
    from edgespec import __version__

    typer.echo(__version__)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
