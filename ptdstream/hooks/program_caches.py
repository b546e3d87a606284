"""Upstream's references to finished programs, dropped: three that keep a whole graph alive.

Each holds fx nodes, and a node holds its graph, its graph module and every
node's metadata (fake tensors, stack traces, provenance), so one reference keeps
a program's objects resident after the export that made it is done with it,
for the rest of the process:

* dynamo's export capture (``torch/_dynamo/functional_export.py``) installs each
  captured graph in that module's globals as ``__compiled_fn_<n>_<uuid>``, a name
  used only while the capture runs, and never removes it: one per
  ``torch.export`` (optimum exports a causal LM twice) and per XNNPACK
  partition's re-export. :func:`counting_export` around each export removes,
  when the last export it counts returns, every ``__compiled_fn_`` name added to
  that module since the first began (the names are process-wide: one added by a
  capture it does not count, running meanwhile, goes too; such a capture passes
  its function to the code it runs, so it completes as it would).
* ``is_same_node`` (``exir/backend/utils.py``), an unbounded ``lru_cache`` over
  pairs of nodes that ``to_backend``'s graph check fills with every node of the
  edge program and its partitioned copy.
* XNNPACK's ``why`` (``backends/xnnpack/partition/config/xnnpack_config.py``),
  which keeps the last node it logged a partitioning refusal for.

:func:`forget_node_caches` empties the last two. A cache emptied costs a later
comparison its memo, nothing else: no byte written changes. The names are
registered in :mod:`ptdstream.upstream.names`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ..upstream import adapter

__all__ = ["CAPTURED_PREFIX", "capture_globals", "counting_export", "forget_captured_graphs", "forget_node_caches"]

#: the names dynamo's capture gives the graphs it installs (``OutputGraph.install_global``)
CAPTURED_PREFIX = "__compiled_fn_"


class _InFlight:
    """The exports :func:`counting_export` counts, and the capture globals before the first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.before: frozenset[str] = frozenset()


_in_flight = _InFlight()


def capture_globals() -> frozenset[str]:
    """The names dynamo's export capture module holds now (empty when it is not importable)."""
    module = adapter.dynamo_capture_module()
    return frozenset() if module is None else frozenset(vars(module))


@contextlib.contextmanager
def counting_export() -> Iterator[None]:
    """Count one ``torch.export`` in flight; when the last one in flight returns
    (or raises), the captured graphs added since the first of them began are
    removed (:func:`forget_captured_graphs`)."""
    with _in_flight.lock:
        if _in_flight.count == 0:
            _in_flight.before = capture_globals()
        _in_flight.count += 1
    try:
        yield
    finally:
        with _in_flight.lock:
            _in_flight.count -= 1
            if _in_flight.count == 0:
                forget_captured_graphs(_in_flight.before)


def forget_captured_graphs(before: frozenset[str]) -> int:
    """Remove the ``__compiled_fn_`` globals of dynamo's export capture module
    that are not in ``before`` (:func:`capture_globals`); returns how many. Call
    it only when no capture is running: a capture looks its own name up."""
    module = adapter.dynamo_capture_module()
    if module is None:
        return 0
    table = vars(module)
    added = [n for n in list(table) if n.startswith(CAPTURED_PREFIX) and n not in before]
    for name in added:
        table.pop(name, None)
    return len(added)


def forget_node_caches() -> None:
    """Empty ``is_same_node``'s cache and XNNPACK's last refused node (module
    docstring); either missing (not installed) is skipped."""
    same_node = adapter.same_node_cache()
    if same_node is not None:
        same_node.cache_clear()
    why = adapter.xnnpack_refusal_log()
    if why is not None:
        why.node = None
