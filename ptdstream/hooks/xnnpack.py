"""XNNPACK's constants by reference: the delegate keeps a reference to each weight's storage, not a copy.

executorch 1.5.1's XNNPACK backend serializes every constant it takes in
``backends/xnnpack/operators/node_visitor.py``,
``NodeVisitor.get_serialized_buffer_index``: it takes the weight
(``get_param_tensor``), makes it contiguous and fp32 (or quantizes, packs,
permutes it), then calls ``bytes(array)`` twice on a ``ctypes`` view of the
result's storage: once for the SHA-256 that names it, once for the copy it
adds to the ``NamedDataStore``, where it stays until the manager is dropped.
For a float model that is one more copy of nearly every weight.

Inside :func:`xnnpack_constants_by_reference`, a ``bytes(array)`` call of that
module whose ``array`` is exactly the storage of the parameter
``get_param_tensor`` just returned (the weight went through unchanged: already
contiguous, already the dtype XNNPACK keeps) returns a
:class:`~ptdstream.hooks.emitter.StorageReference` instead; the module's
``hashlib.sha256`` of it streams the storage (the same digest, so the same
key), and the ``NamedDataStore`` takes it as it takes a file
(``FileBackedData``). A converted weight (quantized, packed, permuted, cast)
is a new tensor at another address: it is copied as upstream does. A storage
mapped from a file (safetensors, ``torch.load(mmap=True)``) is read piece by
piece, as under :func:`ptdstream.constants_by_reference` (the hash keeping its
page cache for the save, the save dropping it). Both calls for one weight get
the same reference: the one the ``NamedDataStore`` keeps is the one hashed (its
SHA-256 cached, and the xxh3-128 of that read handed to the save, which refuses
bytes changed since).

Inside :func:`spilling_converted` too (the weightless route's: weights_from
opens it), a converted constant of at least :data:`SPILL_MIN_NBYTES` (a packed
4-bit weight, its bf16 scales) is handed to the spill it names, which writes
its bytes to a nameless file and maps them back; both calls for it get a
reference to that mapping, so lowering holds no copy of it either. The second
call is matched to the first by address, size and bytes (compared).

The XNNPACK lowering runs in ``to_edge_transform_and_lower``: wrap that call
(optimum-executorch: the whole ``main_export``). ``ptdstream.save`` and
upstream's writers write the same bytes as without the context. The module's
global names ``bytes``, ``hashlib`` and ``get_param_tensor`` are shadowed while
a context is active (through :func:`ptdstream.upstream.patching.shadowed`);
only the thread or task that entered a context gets references. The names are
registered in :mod:`ptdstream.upstream.names` (checked against each release).
"""

from __future__ import annotations

import builtins
import contextlib
import contextvars
import ctypes
import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..upstream import adapter
from ..upstream.patching import shadowed
from .emitter import reference
from .interop import EMITTER_HASHLIB
from .reachability import compact_dependency_viewers

__all__ = ["SPILL_MIN_NBYTES", "reference_converted", "spilling_converted", "xnnpack_constants_by_reference"]

#: A converted constant at least this large goes to the spill of :func:`spilling_converted`, when one is open
#: (smaller ones cost a mapping more than they hold; a layer's 4-bit scales are tens to hundreds of KiB each).
SPILL_MIN_NBYTES = 64 << 10
_spill: contextvars.ContextVar = contextvars.ContextVar("ptdstream_xnnpack_spill", default=None)

_entered: contextvars.ContextVar = contextvars.ContextVar("ptdstream_xnnpack_by_reference", default=())
_open: set = set()
_ids = itertools.count()
_last = threading.local()  # the parameter get_param_tensor returned last in this thread


def _active() -> bool:
    return any(i in _open for i in _entered.get())


def _tracking(real):
    """Wrap ``get_param_tensor`` so that :func:`_node_visitor_bytes` knows the weight."""

    @functools.wraps(real)
    def get_param_tensor(*args, **kwargs):
        tensor = real(*args, **kwargs)
        if _active():
            _last.tensor = tensor
            _last.reference = None
            _last.converted = None
        return tensor

    return get_param_tensor


def _node_visitor_bytes(*args, **kwargs):
    """``bytes`` as XNNPACK's node visitor module sees it inside a context."""
    import torch

    tensor = getattr(_last, "tensor", None)
    if (
        isinstance(tensor, torch.Tensor)
        and len(args) == 1
        and not kwargs
        and isinstance(args[0], ctypes.Array)
        and _active()
    ):
        storage = tensor.untyped_storage()
        view = args[0]
        if (
            storage.device.type == "cpu"
            and storage.nbytes() > 0
            and ctypes.addressof(view) == storage.data_ptr()
            and ctypes.sizeof(view) == storage.nbytes()
        ):
            last = getattr(_last, "reference", None)
            if last is not None and last[0] is tensor:
                return last[1]  # the second call (the NamedDataStore's copy): the reference just hashed
            ref = reference(storage)
            _last.reference = (tensor, ref)
            return ref
    converted = getattr(_last, "converted", None)
    if (converted is not None and len(args) == 1 and not kwargs and isinstance(args[0], ctypes.Array)
            and _active()):
        storage = converted[0].untyped_storage()
        if ctypes.addressof(args[0]) == storage.data_ptr() and ctypes.sizeof(args[0]) == storage.nbytes():
            if converted[1] is None:
                converted[1] = reference(storage)
            return converted[1]  # both calls (the hash, the NamedDataStore's copy): one reference
    spill = _spill.get()
    if (spill is not None and len(args) == 1 and not kwargs and isinstance(args[0], ctypes.Array)
            and ctypes.sizeof(args[0]) >= SPILL_MIN_NBYTES and _active()):
        return _spilled(args[0], spill)
    return builtins.bytes(*args, **kwargs)


def reference_converted(tensor: Any) -> None:
    """Make XNNPACK's next ``bytes()`` calls of ``tensor``'s whole storage (a
    converted constant already in a file, such as a 4-bit weight packed by
    :mod:`ptdstream.hooks.xnnpack_qc4w`) return one reference to it, in this
    thread, inside :func:`xnnpack_constants_by_reference`: neither copied nor spilled."""
    _last.converted = [tensor, None]


def _spilled(view: ctypes.Array, spill: Callable[[memoryview], Any]) -> Any:
    """A reference to ``view``'s bytes written by ``spill``; the same one for the call that follows with the
    same bytes at the same address (upstream hashes, then adds the constant)."""
    import numpy

    where = (ctypes.addressof(view), ctypes.sizeof(view))
    pending = getattr(_last, "spilled", None)
    _last.spilled = None
    data = memoryview(view).cast("B")
    if pending is not None and pending[0] == where and numpy.array_equal(
            numpy.frombuffer(data, dtype=numpy.uint8), pending[1].numpy()):
        return pending[2]
    mapped = spill(data)
    ref = reference(mapped.untyped_storage())
    _last.spilled = (where, mapped, ref)
    return ref


@contextlib.contextmanager
def spilling_converted(spill: Callable[[memoryview], Any]) -> Iterator[None]:
    """While active in this thread or task (inside :func:`xnnpack_constants_by_reference`),
    each converted constant XNNPACK serializes of at least :data:`SPILL_MIN_NBYTES`
    is given to ``spill`` (its bytes), which returns a flat ``torch.uint8`` CPU
    tensor holding them (a file mapping); the ``NamedDataStore`` keeps a reference
    to it, not a copy. Nests (the innermost spill is used)."""
    token = _spill.set(spill)
    try:
        yield
    finally:
        _last.spilled = None
        _spill.reset(token)


@contextlib.contextmanager
def xnnpack_constants_by_reference() -> Iterator[None]:
    """While active, XNNPACK's lowering keeps unchanged weights as references to their storages.

    Wrap ``to_edge_transform_and_lower`` (where XNNPACK serializes its
    constants). Host memory saved: one copy of every weight XNNPACK takes
    unchanged (fp32 weights of a fp32 model, fp16/bf16 ones of a fp16/bf16
    model); quantized weights are new tensors and copied as upstream does. Do
    not change the weights in place before the save: ``ptdstream.save`` then
    raises ``IntegrityError`` naming the key.

    While active, the partitioners also hold their reachability sets as bitsets
    (:func:`ptdstream.hooks.reachability.compact_dependency_viewers`, in every
    thread): the same partitions in memory linear in the graph.

    Applies to the calling thread or asyncio task; nests; the patches are
    removed when the last context exits.

    Raises:
        ImportError: executorch's XNNPACK backend is not importable.
    """
    module = adapter.xnnpack_node_visitor_module()
    context_id = next(_ids)
    _open.add(context_id)
    token = _entered.set(_entered.get() + (context_id,))
    try:
        with shadowed(module, "bytes", _node_visitor_bytes), shadowed(module, "hashlib", EMITTER_HASHLIB), \
                shadowed(module, "get_param_tensor", _tracking(module.get_param_tensor)), \
                compact_dependency_viewers():
            yield
    finally:
        _open.discard(context_id)
        _last.tensor = None
        _last.reference = None
        _last.converted = None
        try:
            _entered.reset(token)
        except ValueError:
            pass  # exited in another thread: the id is closed, which is what counts
