"""glibc heap settings for the engine's numpy work (one call per process, before inference).

Every step builds a few vocabulary-sized float64 temporaries (49152 x 8 bytes = 384 KiB): logits
to probabilities, the sampling transform, the verifier's residuals. glibc hands the freed top of
the heap back to the kernel as soon as it exceeds its trim threshold, so the next temporary
faults its ~96 pages in afresh, and those page faults can cost several times the arithmetic of a
step's `logits_to_probs`. With the thresholds raised, freed memory stays mapped. Allocations under 32 MiB then come from
the heap, and up to 32-64 MiB of freed heap stays resident per arena that used it.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
# Setting any of these freezes glibc's dynamic mmap threshold where it stands (128 KiB in a
# fresh process): the mmap threshold must then be set too, or every temporary is a fresh mmap.
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TOP_PAD, 32 << 20), (M_TRIM_THRESHOLD, 64 << 20))
# an operator's own glibc tunables win over ours
OPERATOR_VARS = ("MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Make glibc keep freed heap memory for reuse instead of trimming it back to the kernel.
    False (and nothing changed) where the operator set glibc's malloc tunables or
    EDGESPEC_KEEP_HEAP=0, or where the C library has no `mallopt` (not glibc)."""
    if os.environ.get("EDGESPEC_KEEP_HEAP", "1") == "0" or any(v in os.environ for v in OPERATOR_VARS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)
