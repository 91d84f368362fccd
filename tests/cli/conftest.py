"""The client commands' tests run against the server tests' daemon around the fake engine."""

from tests.server.conftest import make_daemon

__all__ = ["make_daemon"]
