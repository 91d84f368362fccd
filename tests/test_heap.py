"""glibc heap settings: with them, the step's vocabulary-sized numpy temporaries reuse freed heap
instead of faulting fresh pages in on every call. Counted in page faults, not timed."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")

PROBE = """
import resource, sys, numpy as np
from edgespec.heap import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
if sys.argv[1] == "backend":  # what every process that loads a model does first
    from edgespec import backend
    backend._init()
from edgespec.sampling import logits_to_probs, SamplingParams
x = np.random.default_rng(0).standard_normal(49152).astype(np.float32)
s = SamplingParams(temperature=0.7, top_p=0.95)
for _ in range(20):
    logits_to_probs(x, s)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    logits_to_probs(x, s)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def clean_env() -> dict[str, str]:
    """This environment without any malloc tunables (ours or the operator's)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "EDGESPEC_KEEP_HEAP")}


def faults(mode: str, **env: str) -> int:
    clean = clean_env()
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                         env={**clean, **env}, check=True)
    return int(out.stdout.split()[-1])


def test_freed_heap_is_kept_for_the_next_temporary():
    # 200 sampling transforms (temperature + top_p) over a 49152-token vocabulary
    assert faults("keep") <= 20
    assert faults("default") >= 200 * 20  # glibc's default: ~114 fresh pages per call here


def test_operator_tunables_win():
    code = "import sys; from edgespec.heap import keep_freed_memory; sys.exit(0 if keep_freed_memory() else 3)"
    clean = clean_env()
    assert subprocess.run([sys.executable, "-c", code], env=clean, timeout=60).returncode == 0
    assert subprocess.run([sys.executable, "-c", code], env={**clean, "MALLOC_TOP_PAD_": "0"}, timeout=60).returncode == 3
    assert subprocess.run([sys.executable, "-c", code], env={**clean, "EDGESPEC_KEEP_HEAP": "0"}, timeout=60).returncode == 3


def test_the_backend_applies_it():
    assert faults("backend") <= 20
