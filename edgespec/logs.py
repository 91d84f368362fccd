"""structlog set-up: configured once, before heavy imports. JSON lines under systemd or when
stdout is not a TTY, a console renderer on a TTY. Request ids are bound through contextvars."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure(level: str = "info", json: bool | None = None) -> None:
    """Idempotent. `json=None` picks JSON under systemd (INVOCATION_ID/JOURNAL_STREAM) or no TTY."""
    global _configured
    if json is None:
        under_systemd = bool(os.environ.get("INVOCATION_ID") or os.environ.get("JOURNAL_STREAM"))
        json = under_systemd or not sys.stderr.isatty()
    lvl = getattr(logging, level.upper(), logging.INFO)
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str = "edgespec") -> structlog.typing.FilteringBoundLogger:
    if not _configured:
        configure(level=os.environ.get("EDGESPEC_LOG_LEVEL", "warning"))
    return structlog.get_logger(name)


bind_request_id = structlog.contextvars.bind_contextvars
clear_request = structlog.contextvars.clear_contextvars
