"""XNNPACK lowering of bound programs: its constants by reference, its per-partition copy sharing them.

``to_backend`` deep-copies each partition's program before the backend's
``preprocess`` (``exir/backend/backend_api.py`` calls
``BackendDetails.copy_exported_program_for_preprocess``, ``copy.deepcopy``):
for a program bound to a checkpoint that is a host copy of every mapped weight
of the partition. While :func:`sharing_bound_weights` is active, XNNPACK's
copy (``XnnpackBackend``, which does not override the method) shares the
tensors bound by an open :func:`~ptdstream.weightless.weights_from` context
instead, as executorch's CUDA backend does in its low-memory mode
(``backends/cuda/cuda_backend.py::copy_exported_program_for_preprocess``); every
other tensor, and the graph, is copied as upstream does. XNNPACK's
``preprocess`` reads weights and builds new tensors for what it transforms; it
does not write the program's tensors; after each ``preprocess`` the pages it
read of the files the open contexts wrote (quantized weights, folded
constants) are unmapped from the process. The patches are scoped through
:mod:`ptdstream.upstream.patching`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from ..hooks.xnnpack import spilling_converted, xnnpack_constants_by_reference
from ..hooks.xnnpack_qc4w import packing_qc4w_in_bands
from ..upstream.patching import shadowed
from .lowering import release_file_pages
from .mapped_copy import RowFiles, mapped_copy

__all__ = ["add_bound", "bound_weights", "is_bound", "sharing_bound_weights"]

_lock = threading.Lock()
_bound: dict[int, int] = {}  # id(bound tensor) -> number of contexts holding it (they keep it alive)


@contextlib.contextmanager
def bound_weights(tensors: list[Any]) -> Iterator[list[Any]]:
    """Register ``tensors`` (a list the caller keeps appending bound tensors to,
    and keeps alive) as shared by XNNPACK's copy until exit."""
    try:
        yield tensors
    finally:
        with _lock:
            for t in tensors:
                n = _bound.get(id(t), 0) - 1
                if n > 0:
                    _bound[id(t)] = n
                else:
                    _bound.pop(id(t), None)


def add_bound(tensors: list[Any], new: Iterable[Any]) -> None:
    """Append ``new`` to ``tensors`` (a :func:`bound_weights` list) and register them."""
    with _lock:
        for t in new:
            tensors.append(t)
            _bound[id(t)] = _bound.get(id(t), 0) + 1


def is_bound(tensor: Any) -> bool:
    """Whether ``tensor`` (the object itself) is registered by an open context."""
    with _lock:
        return id(tensor) in _bound


def _spill_to(folder: str, data: memoryview) -> Any:
    import torch

    return mapped_copy(torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8),
                       folder)


def _sharing_copy(cls, edge_program, compile_specs):
    with _lock:
        memo = {id(t): t for values in (edge_program.state_dict, edge_program.constants)
                for t in values.values() if id(t) in _bound}
    return copy.deepcopy(edge_program, memo)


def _releasing_after(real):
    @functools.wraps(real)
    def preprocess(edge_program, compile_specs):
        try:
            return real(edge_program, compile_specs)
        finally:
            release_file_pages()  # what packing this partition read of the files the contexts wrote

    return preprocess


@contextlib.contextmanager
def sharing_bound_weights(folder: str | None = None) -> Iterator[None]:
    """While active, XNNPACK keeps unchanged weights by reference
    (:func:`ptdstream.hooks.xnnpack.xnnpack_constants_by_reference`), with a
    ``folder``, the converted ones it packs (4-bit weights, their scales) of at
    least 64 KiB in nameless files there, mapped back
    (:func:`ptdstream.hooks.xnnpack.spilling_converted`; a large 4-bit weight
    packed band by band straight into such a file:
    :func:`ptdstream.hooks.xnnpack_qc4w.packing_qc4w_in_bands`), its per-partition
    copy shares the bound tensors, and after each partition's ``preprocess``
    the pages it read of the open contexts' files are unmapped
    (:func:`~ptdstream.weightless.lowering.release_file_pages`). Does nothing when executorch's XNNPACK
    backend is not importable."""
    try:
        from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
    except ImportError:
        XnnpackBackend = None
    with contextlib.ExitStack() as patches:
        if XnnpackBackend is not None:
            patches.enter_context(xnnpack_constants_by_reference())
            if folder is not None:
                patches.enter_context(spilling_converted(functools.partial(_spill_to, folder)))
                patches.enter_context(packing_qc4w_in_bands(functools.partial(RowFiles, folder)))
            patches.enter_context(shadowed(XnnpackBackend, "copy_exported_program_for_preprocess",
                                           classmethod(_sharing_copy)))
            patches.enter_context(shadowed(XnnpackBackend, "preprocess",
                                           staticmethod(_releasing_after(XnnpackBackend.preprocess))))
        yield
