"""A real daemon process around the fake engine, for tests that need several daemons or need to
kill one with a signal: `python -m tests.server.fake_daemon [STEP_SECONDS]`. Prints
`SERVING host:port` when ready; JSON logs (info) on stderr."""

from __future__ import annotations

import sys

from edgespec.logs import configure
from edgespec.server.config import load
from edgespec.server.daemon import run
from tests.fake_engine import FakeEngine


def main() -> int:
    configure("info", json=True)
    step = float(sys.argv[1]) if len(sys.argv) > 1 else 0.002
    cfg = load(None, env={}, overrides={"server": {"port": 0, "parallel": 2, "queue_size": 32, "grace_seconds": 2.0}})
    return run(cfg, engine_factory=lambda: FakeEngine(parallel=2, n_ctx=8192, step_seconds=step))


if __name__ == "__main__":
    sys.exit(main())
