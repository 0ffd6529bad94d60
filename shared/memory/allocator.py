"""Handing the C heap's free memory back to the kernel between steps (glibc's `malloc_trim`).

Autograd allocates every gradient tensor afresh. glibc serves a big allocation with its own mapping, returned
at free, until one is freed: then it raises its mmap threshold to that size (up to 32 MiB) and serves tensors of
that size from the heap, which keeps their pages when they are freed and fragments as sizes interleave. A
worker of a model with 24 MB tensors then peaks a tensor or two higher from one run to the next
(docs/design.md §8). `trim` gives the free pages back; the next step faults them in again, a cost of about
one memory pass over the gradient, so it is spent only on models big enough for the memory to matter
(`worth_trimming`). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

TRIM_MIN_BYTES = 64 << 20  # models with fewer parameter bytes keep their heap: a few MB, and millisecond steps


@cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def worth_trimming(param_bytes: int) -> bool:
    return param_bytes >= TRIM_MIN_BYTES


def trim() -> bool:
    """Give the heap's free pages back to the kernel; True if the C library could."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
