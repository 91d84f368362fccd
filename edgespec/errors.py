"""The small exception tree every layer raises; the gRPC layer maps it to status codes in one place."""

from __future__ import annotations


class EdgespecError(Exception):
    """Base of every error edgespec raises on purpose."""


MAX_MESSAGE_CHARS = 400  # a BadRequest's message at most: it echoes the caller's value into logs


class BadRequest(EdgespecError):
    """The caller sent something invalid. `field` names the offending field. The message (which
    may quote the rejected value) is cut to MAX_MESSAGE_CHARS: a caller's megabyte-long value
    never reaches the logs or the answer whole, whatever `log_text` says."""

    def __init__(self, field: str, message: str):
        self.field = field
        if len(message) > MAX_MESSAGE_CHARS:
            message = f"{message[:MAX_MESSAGE_CHARS]}... ({len(message)} characters)"
        super().__init__(f"{field}: {message}")


class UnknownModel(BadRequest):
    """The request names a model this server does not serve (HTTP 404, gRPC NOT_FOUND)."""


class ConfigError(EdgespecError):
    """A configuration file/env/flag value is invalid. `key` names it."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


class Overloaded(EdgespecError):
    """The admission queue is full."""


class ModelError(EdgespecError):
    """A model file is missing, corrupt, or llama.cpp failed on it."""


class IncompatibleDraft(ModelError):
    """The draft model cannot draft for the target (vocabulary differs)."""


class ForwardAborted(ModelError):
    """A forward stopped part-way because its context was told to abort (a cancel or a deadline
    of every request in it): llama.cpp dropped the cells of the piece it was computing. The
    sessions in it must be closed."""


class Cancelled(EdgespecError):
    """The request was cancelled by its caller."""


class DeadlineExceeded(EdgespecError):
    """The caller's deadline passed before generation finished."""


class NotReady(EdgespecError):
    """The daemon is loading or draining."""
