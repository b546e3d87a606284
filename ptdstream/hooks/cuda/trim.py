"""Handing the host heap back after each method's collect (``stream_cuda_weights(trim_host_memory=)``).

executorch 1.5.1's ``backends/cuda/cuda_weight_collector.py::trim_host_memory``
runs ``gc.collect()`` and glibc's ``malloc_trim(0)`` before and after each
method's ``materialize``. The ``malloc_trim`` is what returns to the system the
heap each method's AOTI compile (Inductor, triton, the C++ build) freed but
glibc kept; each full collection walks every object of the lowered programs.
The modes:

* :data:`MALLOC_TRIM` (the default): upstream's call is skipped and
  ``malloc_trim(0)`` runs once, after each method's collect;
* ``True``: upstream's own ``gc.collect()`` + ``malloc_trim(0)``, twice per method;
* ``False``: neither.
"""

from __future__ import annotations

from typing import Any

from ...errors import ArgumentTypeError
from ...system.heap import malloc_trim

__all__ = ["MALLOC_TRIM", "TRIM_MODES", "check_mode", "malloc_trim"]

MALLOC_TRIM = "malloc_trim"
TRIM_MODES = (MALLOC_TRIM, True, False)


def check_mode(mode: Any) -> bool | str:
    """``mode`` when it is one of :data:`TRIM_MODES`: exactly the ``str``
    ``"malloc_trim"`` or a ``bool`` (no subclass, no array, nothing compared with ``==``).

    Raises:
        ArgumentTypeError: any other value (names it, its type and the modes accepted).
    """
    if type(mode) is bool or (type(mode) is str and mode == MALLOC_TRIM):
        return mode
    kind = type(mode)
    kind_name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    shown = repr(mode)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise ArgumentTypeError(f"stream_cuda_weights: trim_host_memory={shown} (a {kind_name}) is not one of "
                            f"{MALLOC_TRIM!r}, True, False; pass one of those")
