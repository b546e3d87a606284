"""Constants by reference: executorch's emitter keeps a reference to each constant's storage, not a copy.

executorch 1.5.1's emitter (``exir/emit/_emitter.py``,
``_Emitter._tensor_spec_to_evalue``) copies every constant storage into Python
``bytes`` (``bytes(ctypes.cast(storage.data_ptr(), ...).contents)``), SHA-256s
the copy and keeps it in ``constant_buffer`` (``.pte``), ``mutable_buffer`` or
``external_constant_buffer`` (``.ptd``) until the manager is dropped: one more
copy of every weight, on top of the model's own.

Inside :func:`constants_by_reference`, that one ``bytes(...)`` call returns a
:class:`StorageReference` instead: a ``FileBackedData`` (executorch's ``Cord``
and ``NamedDataStore`` take it as they take a file) that reads the storage
through a :class:`~ptdstream.sources.TensorSource`, which re-checks the
storage's address and size at every read. The emitter's
``hashlib.sha256(...)`` of it is computed by streaming those pieces (so its
dedup classes are upstream's), and an xxh3-128 fingerprint is taken in the same
pass: the save refuses, naming the key, a constant whose bytes changed after
emission. ``ptdstream.save`` streams it from the tensor; upstream's
``write_to_file`` still writes the same bytes.

How: the emitter module's global names ``bytes`` and ``hashlib`` are shadowed
while a context is active (builtins and imports are looked up in module
globals), and ``_Emitter._tensor_spec_to_evalue`` is wrapped to know which spec
it is emitting; only a call whose argument is exactly that spec's CPU storage
is answered with a reference, and only in a context (thread or asyncio task)
that entered :func:`constants_by_reference`. No upstream code is copied. The
names are registered in :mod:`ptdstream.upstream.names` (checked against each
release); the patches are scoped (:mod:`ptdstream.upstream.patching`).

A storage mapped from a file (``torch.load(mmap=True)``, safetensors) is read
piece by piece into a ring and each piece is unmapped from the process at once,
so a memory-mapped checkpoint is never resident as a whole: the emitter's hash
keeps its pages in the page cache (the save reads them again soon), the save
pages them out (``MADV_PAGEOUT``; see
:meth:`~ptdstream.sources.mapped.MappedTensorSource.pieces_keeping_cache`).
"""

from __future__ import annotations

import builtins
import contextlib
import contextvars
import ctypes
import functools
import hashlib
import itertools
import threading
from collections.abc import Iterator

from ..sources import BufferRing
from ..sources.base import Expectation
from ..sources.fingerprint import StreamingDigest
from ..sources.mapped import MappedTensorSource, opened_identity
from ..sources.tensor import TensorSource
from ..system.pagecache import file_mapping
from ..upstream import adapter
from ..upstream.patching import shadowed
from .interop import EMITTER_HASHLIB, ByReference, SourceBackedData

__all__ = ["StorageReference", "constants_by_reference", "reference"]

# Contexts entered by the current thread or task (ids), and those still open anywhere:
# a context exited from another thread is closed for the one that entered it too.
_entered: contextvars.ContextVar = contextvars.ContextVar("ptdstream_constants_by_reference", default=())
_open: set = set()
_ids = itertools.count()
_emitting = threading.local()  # the spec being emitted (set and cleared within one call)


class StorageReference(ByReference, SourceBackedData):
    """A constant's bytes as a reference to its CPU storage (no copy).

    Made by :func:`reference`. ``len()`` is the storage size in bytes;
    ``source`` reads it (a :class:`MappedTensorSource` when ``file_mapped``).
    :meth:`sha256` streams it once and hands the source over with the xxh3-128
    digest of the same pass (``source.expectation.fingerprint``). Copying returns the same object; pickling
    gives plain ``bytes`` (see :class:`~ptdstream.hooks.interop.ByReference`).
    """

    file_mapped = False

    def sha256(self) -> bytes:
        """SHA-256 of the bytes, streamed from the storage (cached)."""
        cached = adapter.cached_sha256(self)
        if cached is None:
            sha, xxh = hashlib.sha256(), StreamingDigest()
            # a mapped storage is hashed while exporting and read again by the save: its page cache is kept
            pieces = (self.source.pieces_keeping_cache(BufferRing(self._chunk_nbytes, count=3))
                      if isinstance(self.source, MappedTensorSource) else self._pieces())
            for piece in pieces:
                sha.update(piece)
                xxh.update(piece)
            cached = sha.digest()
            adapter.set_cached_sha256(self, cached)
            self.source.hand_over(xxh.finish())
        return cached

    def __repr__(self) -> str:
        return f"<StorageReference {self.source.describe()} ({len(self)} bytes)>"


def reference(storage, name: str | None = None) -> StorageReference:
    """A :class:`StorageReference` over a CPU ``torch.UntypedStorage`` (all its bytes).

    ``name`` (the tensor's fully qualified name, when the emitter knows it) goes
    into error messages. A storage mapped from a file registered by
    :func:`~ptdstream.sources.mapped.expecting_files` (an open ``weights_from``
    context's checkpoint) expects that file's identity when it was opened, checked
    at every read of the save, whatever thread saves.

    Raises:
        ValueError: the storage is not on the CPU.
    """
    import torch

    if storage.device.type != "cpu":
        raise ValueError(f"a storage reference needs a CPU storage, got one on {storage.device}")
    nbytes = storage.nbytes()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
    mapping = file_mapping(storage.data_ptr(), nbytes) if nbytes else None
    at = f" at offset {mapping.offset + storage.data_ptr() - mapping.start:,} of its file" if mapping else ""
    label = f"constant {name!r} ({nbytes} bytes{at})" if name else f"constant storage ({nbytes} bytes{at})"
    ref = StorageReference(MappedTensorSource(flat, mapping, label, expectation=Expectation(
        file=opened_identity(mapping))) if mapping else TensorSource(flat, label))
    ref.file_mapped = mapping is not None
    return ref


def _emitter_bytes(*args, **kwargs):
    """``bytes`` as the emitter module sees it while :func:`constants_by_reference` is active."""
    spec = getattr(_emitting, "spec", None)
    if spec is not None and len(args) == 1 and not kwargs and isinstance(args[0], ctypes.Array):
        storage = adapter.tensor_spec_storage(spec)
        view = args[0]
        if (
            storage is not None
            and storage.device.type == "cpu"
            and ctypes.addressof(view) == storage.data_ptr()
            and ctypes.sizeof(view) == storage.nbytes()
        ):
            _emitting.spec = None
            return reference(storage, adapter.tensor_spec_fqn(spec))
    return builtins.bytes(*args, **kwargs)


def _spec_tracking(real):
    """Wrap ``_Emitter._tensor_spec_to_evalue`` so that :func:`_emitter_bytes` knows the spec."""

    @functools.wraps(real)
    def tensor_spec_to_evalue(self, spec, *args, **kwargs):
        if not any(i in _open for i in _entered.get()):  # a thread or task outside any context
            return real(self, spec, *args, **kwargs)
        outer = getattr(_emitting, "spec", None)
        _emitting.spec = spec
        try:
            return real(self, spec, *args, **kwargs)
        finally:
            _emitting.spec = outer

    return tensor_spec_to_evalue


@contextlib.contextmanager
def constants_by_reference() -> Iterator[None]:
    """While active, executorch's emitter keeps constants as references to their storages.

    Wrap ``to_executorch()`` (where the emitter runs); save the manager with
    ``ptdstream.save`` (streams each constant from its tensor) or upstream's
    writers (the same bytes). Host memory saved: one copy of every constant
    (weights, mutable buffers' initial state, external constants). Do not
    change the weights in place between ``to_executorch()`` and the save:
    ``ptdstream.save`` then raises ``IntegrityError`` naming the key (upstream's
    writers would write the new bytes).

    It applies to the calling thread or asyncio task (``contextvars``); other
    threads emit as upstream does. Nests; it may be exited from another thread;
    the patches are removed when the last context exits.

    Raises:
        ImportError: executorch's emitter is not importable.
    """
    module = adapter.emitter_module()
    emitter_class = adapter.emitter_class()
    context_id = next(_ids)
    _open.add(context_id)
    token = _entered.set(_entered.get() + (context_id,))
    try:
        with shadowed(module, "bytes", _emitter_bytes), shadowed(module, "hashlib", EMITTER_HASHLIB), \
                shadowed(emitter_class, "_tensor_spec_to_evalue",
                         _spec_tracking(emitter_class._tensor_spec_to_evalue)):
            yield
    finally:
        _open.discard(context_id)
        try:
            _entered.reset(token)
        except ValueError:
            pass  # exited in another thread: the id is closed, which is what counts
