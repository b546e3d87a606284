"""The C heap: freed memory handed back to the system (glibc's ``malloc_trim``).

glibc keeps what a process frees in its heap (and moves its own threshold for
giving large blocks their own mapping up to the largest block freed, 32 MiB at
most), so an export that makes and frees many tensors of a few MiB (folded
transposes, traced graphs) keeps their pages resident long after: RSS that no
object holds. :func:`malloc_trim` returns every whole free page of the heap
to the system; it frees nothing that is in use.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["malloc_trim"]


@functools.lru_cache(maxsize=1)
def _libc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc: nothing to hand back this way
        return None


def malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``: free heap pages handed back to the system.
    ``False`` where the C library has no ``malloc_trim`` (nothing done)."""
    trim = _libc_trim()
    if trim is None:
        return False
    trim(0)
    return True
