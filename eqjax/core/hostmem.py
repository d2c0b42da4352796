"""Host memory: fixing glibc's mmap threshold so that large freed buffers go back to the system, and handing
the free pages inside the heap back between the units of a streamed run.

glibc raises its mmap threshold to the size of each large buffer freed, up to 32 MB; afterwards buffers of
1-16 MB (a calibration batch's hidden states, weight and Hessian copies) come from the heap, which
fragments, and the process's peak RSS grows with the number of calibration windows although the live
JAX arrays do not (bench/gptq_memory.py). A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, the same as
the ``MALLOC_MMAP_THRESHOLD_`` environment variable) stops that at the cost of fresh pages for every
large buffer, i.e. some time (README, *Not done*).
"""

from __future__ import annotations

import ctypes

__all__ = ["LOW_MEMORY_THRESHOLD", "fix_mmap_threshold", "release_free_memory"]

LOW_MEMORY_THRESHOLD = 4 << 20
"""Bytes: buffers from this size up are mmapped (and unmapped when freed); chosen among 1, 4, 16 and
64 MiB for GPTQ on SmolLM2 (README, *Not done*)."""

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def fix_mmap_threshold(nbytes: int = LOW_MEMORY_THRESHOLD) -> bool:
    """Fix this process's malloc mmap threshold at ``nbytes`` (1 .. 32 MiB): True where the C library
    is glibc and accepted it, False elsewhere (musl, macOS: nothing changes)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 1 <= nbytes <= 32 << 20:
        raise ValueError(f"mmap threshold must be an int of 1 .. {32 << 20} bytes, got {nbytes!r}")
    try:  # the symbols already loaded in this process: glibc's mallopt where glibc is the C library
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, nbytes))


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim(0)``): True where glibc did.

    A freed buffer below the mmap threshold stays in the heap, so a streamed run's resident size would carry
    the previous unit's temporaries into the next (measured on an 8B-shaped block: 0.84 GiB of 2.60 GiB).
    Elsewhere (musl, macOS) nothing happens."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
