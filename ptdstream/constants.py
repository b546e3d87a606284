"""Constants by reference: executorch's emitter keeps a reference to each constant's storage, not a copy.

executorch 1.5.1's emitter (``exir/emit/_emitter.py``,
``_Emitter._tensor_spec_to_evalue``) copies every constant storage into Python
``bytes`` (``bytes(ctypes.cast(storage.data_ptr(), ...).contents)``), SHA-256s
the copy and keeps it in ``constant_buffer`` (``.pte``), ``mutable_buffer`` or
``external_constant_buffer`` (``.ptd``) until the manager is dropped: one more
copy of every weight, on top of the model's own.

Inside :func:`constants_by_reference`, that one ``bytes(...)`` call returns a
:class:`StorageReference` instead: a zero-copy view of the same storage that
keeps the storage alive, exposes the buffer protocol (so the emitter's SHA-256
reads the weights in place and its dedup classes are unchanged) and is a
``FileBackedData`` (executorch's ``Cord`` and ``NamedDataStore`` take it as they
take a file). ``ptdstream.save`` streams it from the tensor; upstream's
``write_to_file`` still writes the same bytes.

How: the emitter module's global name ``bytes`` is shadowed while the context
is active (builtins are looked up in module globals first), and
``_Emitter._tensor_spec_to_evalue`` is wrapped to know which spec it is
emitting; only a call whose argument is exactly that spec's CPU storage is
answered with a reference. No upstream code is copied. The names are listed in
:mod:`ptdstream._upstream` and checked by ``tests/test_upstream.py``.

A storage mapped from a file (``torch.load(mmap=True)``, safetensors) is paged
out of the process (``MADV_PAGEOUT``) once the emitter has hashed it and again
after each piece of the save is copied out, so a memory-mapped checkpoint is never resident
as a whole; its bytes are read from the mapping, so in-place changes are kept.

Caveat: the output holds the tensors' contents at save time, not at
``to_executorch`` time; do not modify the weights in place in between.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import functools
import hashlib
import threading
from typing import Iterator, Tuple

from .interop import BytesLike, SourceBackedData, bytes_like_type
from .pagecache import file_mapping, page_out, will_need
from .sources import BufferRing, TensorSource

_state = threading.local()
_lock = threading.Lock()
_active = 0


class StorageReference(BytesLike, SourceBackedData):
    """A constant's bytes as a reference to its CPU storage (no copy).

    Instances come from :func:`reference`; each is also a ``c_char`` array over
    the storage's memory (the buffer protocol: ``hashlib``, ``memoryview`` and
    ``file.write`` read it in place) and a ``FileBackedData``; copying and
    pickling as for :class:`~ptdstream.interop.BytesLike`. ``len()`` is the
    storage size in bytes; ``file_mapped`` says whether the storage lies in a
    file-backed mapping (then its source is a :class:`MappedTensorSource`).
    """

    def sha256(self) -> bytes:
        """SHA-256 of the bytes, read in place (cached)."""
        if self._sha256 is None:
            self._sha256 = hashlib.sha256(self).digest()
        return self._sha256

    def __repr__(self) -> str:
        return f"<StorageReference {len(self)} bytes at 0x{ctypes.addressof(self):x}>"


class MappedTensorSource(TensorSource):
    """A :class:`~ptdstream.sources.TensorSource` over file-mapped memory (a
    checkpoint loaded with ``mmap``): each piece is copied into the ring and its
    pages are paged out of this process at once, so reading a whole checkpoint
    leaves about one piece resident (the sink may hold ring pieces, never
    views of the mapping)."""

    def __init__(self, tensor, mapping: Tuple[int, int], label: str = "tensor") -> None:  # noqa: D107
        super().__init__(tensor, label)
        self.mapping = mapping

    def pieces(self, ring: BufferRing):
        view = self._view()
        address = self._address()
        step = ring.chunk_nbytes
        will_need(address, 2 * step, self.mapping)
        for start in range(0, self.nbytes, step):
            will_need(address + start + 2 * step, step, self.mapping)  # keep two pieces ahead
            piece = view[start : start + step]
            buf = ring.next()[: len(piece)]
            buf[:] = piece
            page_out(address + start, len(piece), self.mapping)
            yield buf

    def page_out(self) -> None:
        """Reclaim all of this tensor's pages from the process (advice)."""
        page_out(self._address(), self.nbytes, self.mapping)

    def prefix(self, nbytes: int = 32) -> bytes:
        head = super().prefix(nbytes)
        # The fault maps (and reads ahead) more than the page it needs.
        page_out(self._address(), min(self.nbytes, 1 << 20), self.mapping)
        return head

    def _address(self) -> int:
        t = self._tensor
        return t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()


def reference(storage) -> StorageReference:
    """A :class:`StorageReference` over a CPU ``torch.UntypedStorage`` (all its bytes).

    Raises:
        ValueError: the storage is not on the CPU.
    """
    import torch

    if storage.device.type != "cpu":
        raise ValueError(f"a storage reference needs a CPU storage, got one on {storage.device}")
    nbytes = storage.nbytes()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
    ref = bytes_like_type(StorageReference, nbytes).from_address(storage.data_ptr())
    mapping = file_mapping(storage.data_ptr(), nbytes) if nbytes else None
    label = f"constant storage ({nbytes} bytes)"
    source = MappedTensorSource(flat, mapping, label) if mapping else TensorSource(flat, label)
    SourceBackedData.__init__(ref, source)
    ref.file_mapped = mapping is not None
    return ref


def _emitter_bytes(*args, **kwargs):
    """``bytes`` as the emitter module sees it while :func:`constants_by_reference` is active."""
    spec = getattr(_state, "spec", None)
    if spec is not None and len(args) == 1 and not kwargs and isinstance(args[0], ctypes.Array):
        storage = spec.storage
        view = args[0]
        if (
            storage is not None
            and storage.device.type == "cpu"
            and ctypes.addressof(view) == storage.data_ptr()
            and ctypes.sizeof(view) == storage.nbytes()
        ):
            _state.spec = None
            _state.made = reference(storage)
            return _state.made
    return builtins.bytes(*args, **kwargs)


@contextlib.contextmanager
def constants_by_reference() -> Iterator[None]:
    """While active, executorch's emitter keeps constants as references to their storages.

    Wrap ``to_executorch()`` (where the emitter runs); save the manager with
    ``ptdstream.save`` (streams each constant from its tensor) or upstream's
    writers (the same bytes). Host memory saved: one copy of every constant
    (weights, mutable buffers' initial state, external constants). Nests; it
    applies to the calling thread only (other threads emit as upstream does);
    the patch is removed when the last context exits.

    Raises:
        ImportError: executorch's emitter is not importable.
    """
    from ._upstream import emitter_module

    global _active
    module = emitter_module()
    with _lock:
        if _active == 0:
            real = module._Emitter._tensor_spec_to_evalue

            @functools.wraps(real)
            def tensor_spec_to_evalue(self, spec, *args, **kwargs):
                if not getattr(_state, "depth", 0):  # another thread, outside any context
                    return real(self, spec, *args, **kwargs)
                outer = getattr(_state, "spec", None)
                _state.spec, _state.made = spec, None
                try:
                    value = real(self, spec, *args, **kwargs)
                    made = _state.made
                    if made is not None and made.file_mapped:
                        made.source.page_out()  # the emitter has read it (SHA-256)
                    return value
                finally:
                    _state.spec, _state.made = outer, None

            tensor_spec_to_evalue.__wrapped_by_ptdstream__ = real
            module._Emitter._tensor_spec_to_evalue = tensor_spec_to_evalue
            module.bytes = _emitter_bytes
        _active += 1
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
        with _lock:
            _active -= 1
            if _active == 0:
                module._Emitter._tensor_spec_to_evalue = (
                    module._Emitter._tensor_spec_to_evalue.__wrapped_by_ptdstream__
                )
                del module.bytes
