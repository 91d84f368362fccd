"""glibc heap settings: with them, the step's vocabulary-sized numpy temporaries reuse freed heap
instead of faulting fresh pages in on every call, and a training process's 256 MB block is the
next step's memory. Counted in page faults, not timed."""

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


TRAINING_PROBE = """
import ctypes, resource, sys
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: count 4 KB pages, not huge ones
import numpy as np
from edgespec.heap import keep_training_heap
if sys.argv[1] != "default":
    assert keep_training_heap()
if sys.argv[1] == "training+backend":  # train-head's target answering the prompts, after it
    from edgespec import backend
    backend._init()
a = np.ones(64 << 20, np.float32); del a  # 256 MB, touched, freed
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
a = np.ones(64 << 20, np.float32); del a
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.parametrize(("mode", "few"), [("training", True), ("training+backend", True), ("default", False)])
def test_a_training_process_reuses_its_freed_block(mode, few):
    """The second 256 MB block of a process that asked for keep_training_heap is the first
    one's pages (a few faults), also after the backend applied its own settings; glibc's
    default maps it afresh (65,536 pages faulted in again; transparent huge pages are off in
    the probe, as they were for XLA's blocks)."""
    out = subprocess.run([sys.executable, "-c", TRAINING_PROBE, mode], capture_output=True, text=True,
                         timeout=120, env=clean_env(), check=True)
    faulted = int(out.stdout.split()[-1])
    assert (faulted < 2000) if few else (faulted > 60000), faulted
