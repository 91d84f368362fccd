"""glibc heap settings for the engine's numpy work (one call per process, before inference).

Every step builds a few vocabulary-sized float64 temporaries (49152 x 8 bytes = 384 KiB): logits
to probabilities, the sampling transform, the verifier's residuals. glibc hands the freed top of
the heap back to the kernel as soon as it exceeds its trim threshold, so the next temporary
faults its ~96 pages in afresh, and those page faults can cost several times the arithmetic of a
step's `logits_to_probs`. With the thresholds raised, freed memory stays mapped. Allocations under 32 MiB then come from
the heap, and up to 32-64 MiB of freed heap stays resident per arena that used it.

A process that trains a head asks for more (`keep_training_heap`): XLA's CPU runtime allocates
each training step's temporaries as one block of about 250 MB, which glibc serves from a fresh
mmap in a worker thread's arena and unmaps when freed, so every step faulted in some 65,000
pages and spent about a sixth of its time in the kernel.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8
# Setting any of these freezes glibc's dynamic mmap threshold where it stands (128 KiB in a
# fresh process): the mmap threshold must then be set too, or every temporary is a fresh mmap.
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TOP_PAD, 32 << 20), (M_TRIM_THRESHOLD, 64 << 20))
# training: one arena (XLA's worker threads share it), no mmap, no trimming: a block freed at the
# end of a step is the next step's memory, until the process exits
TRAINING = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2 ** 31 - 1))
# an operator's own glibc tunables win over ours
OPERATOR_VARS = ("MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Make glibc keep freed heap memory for reuse instead of trimming it back to the kernel.
    False (and nothing changed) where the operator set glibc's malloc tunables or
    EDGESPEC_KEEP_HEAP=0, or where the C library has no `mallopt` (not glibc)."""
    return _mallopt(SETTINGS)


def keep_training_heap() -> bool:
    """TRAINING's settings, for a process that trains and then exits (`models train-head`); call
    it before jax starts its CPU client, so that XLA's worker threads share the one arena. The
    process keeps its peak heap until it exits. It also sets EDGESPEC_KEEP_HEAP=0, so that a
    llama.cpp backend started later in the process (the target answering the training prompts)
    does not lower the trim threshold to SETTINGS' again: that brought back about 40,000 faults
    a step. False, as keep_freed_memory, where the operator's tunables win or glibc is not there."""
    if not _mallopt(TRAINING):
        return False
    os.environ["EDGESPEC_KEEP_HEAP"] = "0"
    return True


def _mallopt(settings) -> bool:
    if os.environ.get("EDGESPEC_KEEP_HEAP", "1") == "0" or any(v in os.environ for v in OPERATOR_VARS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in settings)
