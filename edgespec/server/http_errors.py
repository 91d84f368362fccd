"""The ONE place where the HTTP APIs' errors become HTTP codes, as status.py maps the same
exception tree to gRPC codes: `STATUS` (most specific first), `error_status` (the status and
OpenAI's error body), `error_response` (the JSON response, with Retry-After and
WWW-Authenticate where they belong; `shape` gives another API's own body, Anthropic's)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog
from starlette.responses import JSONResponse

from edgespec.errors import (
    BadRequest,
    Cancelled,
    ConfigError,
    DeadlineExceeded,
    EdgespecError,
    NotReady,
    Overloaded,
    UnknownModel,
)
from edgespec.logs import get_logger
from edgespec.server import anthropic_api as an
from edgespec.server import openai_api as oa
from edgespec.server.callers import retry_after_seconds
from edgespec.server.origin import CrossSite

log = get_logger("edgespec.server.http_api")

RETRY_AFTER_SECONDS = 1


class Unauthenticated(EdgespecError):
    """Missing or unknown bearer token."""


class PayloadTooLarge(BadRequest):
    """The request body is larger than server.max_message_bytes."""


STATUS: tuple[tuple[type[BaseException], int, str], ...] = (
    (PayloadTooLarge, 413, "invalid_request_error"),
    (UnknownModel, 404, "invalid_request_error"),
    (BadRequest, 400, "invalid_request_error"),
    (ConfigError, 400, "invalid_request_error"),
    (Unauthenticated, 401, "authentication_error"),
    (CrossSite, 403, "permission_error"),
    (Overloaded, 429, "rate_limit_error"),
    (NotReady, 503, "service_unavailable_error"),
    (Cancelled, 499, "cancelled"),
    (DeadlineExceeded, 504, "timeout_error"),
)
CODES = {401: "invalid_api_key", 404: "model_not_found", 413: "request_too_large", 429: "overloaded",
         503: "not_ready", 504: "deadline_exceeded"}


def error_status(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, OpenAI-style error body) for any exception; unexpected ones are 500 with the
    request id (and logged with their traceback by the caller)."""
    for kind, status, type_ in STATUS:
        if isinstance(exc, kind):
            param = getattr(exc, "field", None) if isinstance(exc, BadRequest) else None
            param = getattr(exc, "key", param) if isinstance(exc, ConfigError) else param
            return status, oa.error_body(str(exc), type_, param, CODES.get(status))
    rid = structlog.contextvars.get_contextvars().get("request_id", "-")
    return 500, oa.error_body(f"internal error (request id {rid})", "server_error", None, "internal_error")


Shape = Callable[[int, dict], dict]  # (HTTP status, OpenAI's error body) -> an API's own error body


def anthropic_error(status: int, body: dict) -> dict:
    """Anthropic's error body (the Messages routes') from OpenAI's."""
    return an.error_body(status, body["error"]["message"])


def error_response(exc: BaseException, path: str = "", shape: Shape | None = None) -> JSONResponse:
    status, body = error_status(exc)
    if status == 500:
        log.error("http_failed", path=path, error=repr(exc), exc_info=exc)
    else:
        log.info("http_rejected", path=path, status=status, detail=body["error"]["message"])
    ra = retry_after_seconds(exc)
    headers = {"Retry-After": str(ra or RETRY_AFTER_SECONDS)} if status in (429, 503) else {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(shape(status, body) if shape else body, status_code=status, headers=headers)


__all__: Sequence[str] = ("CODES", "STATUS", "PayloadTooLarge", "Shape", "Unauthenticated", "anthropic_error",
                          "error_response", "error_status")
