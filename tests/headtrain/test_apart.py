"""The trainer stays off the serving floor: importing the daemon and the engine loads neither
`edgespec.headtrain` nor jax (a fresh interpreter, so no other test's imports count)."""

from __future__ import annotations

import subprocess
import sys

CHECK = ("import sys, {mod}; "
         "print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax' or m.startswith('edgespec.headtrain')))")


def loaded(mod: str) -> str:
    r = subprocess.run([sys.executable, "-c", CHECK.format(mod=mod)], capture_output=True, text=True, timeout=120,
                       check=True)
    return r.stdout.strip()


def test_the_daemon_and_the_engine_import_no_trainer_and_no_jax():
    assert loaded("edgespec.server.daemon, edgespec.engine, edgespec.heads.weights") == "[]"


def test_the_check_sees_the_trainer_when_it_is_imported():
    assert "edgespec.headtrain.train" in loaded("edgespec.headtrain.train")
