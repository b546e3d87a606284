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

That costs time where the same large blocks are made and freed over and over
(each new mapping is faulted in page by page: HQQ's iterations over a band of a
weight ran 1.8x slower): inside :func:`reusing_heap_blocks`, blocks under
:data:`REUSED_MAX_NBYTES` come from the heap again, and on exit the fixed
threshold is back and the heap trimmed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["MMAP_THRESHOLD_NBYTES", "REUSED_MAX_NBYTES", "fix_mmap_threshold", "malloc_trim", "reusing_heap_blocks"]

#: blocks at least this size get their own mapping once :func:`fix_mmap_threshold` ran (glibc's starting value)
MMAP_THRESHOLD_NBYTES = 256 << 10
#: at most this many heaps (arenas) once :func:`fix_mmap_threshold` ran: each thread that allocates otherwise gets one
ARENA_MAX = 2
#: inside :func:`reusing_heap_blocks`, blocks under this size come from the heap (glibc's largest threshold)
REUSED_MAX_NBYTES = 32 << 20
#: glibc's default M_TRIM_THRESHOLD: a free top of the heap larger than this goes back to the system at once
TRIM_THRESHOLD_NBYTES = 128 << 10
_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_lock = threading.Lock()
_state: dict[str, Any] = {"fixed": False, "reusing": 0}


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
    with _lock:
        threshold = REUSED_MAX_NBYTES if _state["reusing"] else MMAP_THRESHOLD_NBYTES
        _state["fixed"] = bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_ARENA_MAX, ARENA_MAX))
        return bool(_state["fixed"])


@contextlib.contextmanager
def reusing_heap_blocks() -> Iterator[None]:
    """While active (in any thread: the thresholds are the process's), blocks under
    :data:`REUSED_MAX_NBYTES` come from the heap, where freed ones are reused (glibc's
    ``M_TRIM_THRESHOLD`` raised too: fixing the mmap threshold left it at 128 KiB, so
    a block freed at the top of the heap went back to the system at once and the
    next one was faulted in afresh); when the last one exits, the thresholds
    :func:`fix_mmap_threshold` left are back and the heap is trimmed (:func:`malloc_trim`). Nests. Does nothing before
    :func:`fix_mmap_threshold` ran (glibc then moves its own threshold)."""
    mallopt = _libc("mallopt")
    with _lock:
        _state["reusing"] += 1
        if _state["reusing"] == 1 and _state["fixed"] and mallopt is not None:
            mallopt(_M_MMAP_THRESHOLD, REUSED_MAX_NBYTES)
            mallopt(_M_TRIM_THRESHOLD, 2 * REUSED_MAX_NBYTES)  # a freed top block stays to be reused
    try:
        yield
    finally:
        with _lock:
            _state["reusing"] -= 1
            last = _state["reusing"] == 0 and _state["fixed"] and mallopt is not None
            if last:
                mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_NBYTES)
                mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_NBYTES)
        if last:
            malloc_trim()


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
