"""The C heap: freed memory handed back to the system (glibc's ``malloc_trim``).

glibc keeps what a process frees in its heap (and moves its own threshold for
giving large blocks their own mapping up to the largest block freed, 32 MiB at
most), so an export that makes and frees many tensors of a few MiB (folded
transposes, traced graphs) keeps their pages resident long after: RSS that no
object holds. :func:`malloc_trim` returns every whole free page of the heap
to the system; it frees nothing that is in use. But a free block between two
live ones stays where it is: :func:`fix_mmap_threshold` keeps blocks of
:data:`MMAP_THRESHOLD_NBYTES` and more out of the heap for the rest of the
process (``mallopt(M_MMAP_THRESHOLD)``, which also ends glibc's moving of the
threshold; ``M_ARENA_MAX`` caps the per-thread heaps), so that each is its own
mapping, unmapped when freed, and cannot be stranded by a small block.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["MMAP_THRESHOLD_NBYTES", "fix_mmap_threshold", "malloc_trim"]

#: blocks at least this size get their own mapping once :func:`fix_mmap_threshold` ran (glibc's starting value)
MMAP_THRESHOLD_NBYTES = 256 << 10
#: at most this many heaps (arenas) once :func:`fix_mmap_threshold` ran: each thread that allocates otherwise gets one
ARENA_MAX = 2
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_M_ARENA_MAX = -8


@functools.lru_cache(maxsize=1)
def fix_mmap_threshold() -> bool:
    """Set glibc's ``M_MMAP_THRESHOLD`` to :data:`MMAP_THRESHOLD_NBYTES` and
    ``M_ARENA_MAX`` to :data:`ARENA_MAX`, for the rest of the process (once: later
    calls return the first one's answer). Blocks already allocated stay where they
    are. ``False`` where the C library has no ``mallopt`` or refused a value
    (nothing else changed)."""
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_NBYTES)) and bool(mallopt(_M_ARENA_MAX, ARENA_MAX))


@functools.cache
def _libc(name: str) -> Any:
    """The C library's function ``name``; None where it has none (not glibc)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None


def malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``: free heap pages handed back to the system.
    ``False`` where the C library has no ``malloc_trim`` (nothing done)."""
    trim = _libc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True
