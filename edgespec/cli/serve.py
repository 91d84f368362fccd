"""`edgespec serve`: the gRPC daemon, with the HTTP API when enabled (thin over edgespec.server.daemon)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from edgespec.cli.common import user_errors
from edgespec.settings import setting

_HOST, _PORT, _PARALLEL = setting("server", "host"), setting("server", "port"), setting("server", "parallel")


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve(
        config: Path | None = typer.Option(None, "--config", "-c", help="TOML config (default: $EDGESPEC_CONFIG, else built-in defaults)."),
        host: str | None = typer.Option(None, "--host", help=f"Listen address (default {_HOST.default})."),
        port: int | None = typer.Option(None, "--port", help=f"Listen port (default {_PORT.default}; 0 = any free port)."),
        reflection: bool = typer.Option(False, "--reflection", help="Enable gRPC server reflection."),
        insecure: bool = typer.Option(False, "--insecure", help="Allow a non-loopback address without auth tokens."),
        parallel: int | None = typer.Option(None, "--parallel", help=f"Requests decoded at once, engine slots (default {_PARALLEL.default})."),
        http_port: int | None = typer.Option(None, "--http-port", help="Also serve the OpenAI-compatible HTTP API on this port (0 = any free port)."),
        log_level: str | None = typer.Option(None, "--log-level", help="debug|info|warning|error."),
    ) -> None:
        """Run the gRPC daemon (health NOT_SERVING until both models are loaded and warmed)."""
        with user_errors():
            from edgespec.server import config as daemon_config

            overrides: dict[str, dict] = {"server": {}, "logging": {}, "http": {}}
            if host is not None:
                overrides["server"]["host"] = host
            if port is not None:
                overrides["server"]["port"] = port
            if reflection:
                overrides["server"]["reflection"] = True
            if insecure:
                overrides["server"]["insecure"] = True
            if parallel is not None:
                overrides["server"]["parallel"] = parallel
            if log_level is not None:
                overrides["logging"]["level"] = log_level
            if http_port is not None:
                overrides["http"].update(enabled=True, port=http_port)
            path = config or (Path(os.environ["EDGESPEC_CONFIG"]) if os.environ.get("EDGESPEC_CONFIG") else None)
            cfg = daemon_config.load(path, overrides=overrides, check_models=True)

            from edgespec import logs  # logging before the heavy imports (grpc, llama_cpp)

            js = cfg.logging.json
            logs.configure(level=cfg.logging.level, json=None if js == "auto" else bool(js))

            from edgespec.server.daemon import run

            code = run(cfg)
        sys.exit(code)
