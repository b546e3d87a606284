"""Sources: where segment payload comes from, read in fixed-size pieces.

A :class:`Source` knows its size in bytes without reading anything, gives its
first bytes cheaply (the dedup candidate filter) and yields its payload as
consecutive ``memoryview`` pieces of at most ``chunk_nbytes``. In-memory sources
(bytes, CPU tensors) yield zero-copy slices of their own memory; file sources
read into a :class:`BufferRing` allocated once per save, so no buffer is
allocated per piece.

CUDA tensors are handled by :mod:`ptdstream.cuda`, imported only when a CUDA
tensor is seen: this module imports and runs without CUDA.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Iterator, List, Optional

from .errors import IntegrityError, LayoutError
from .pagecache import drop_pages

#: Default piece size: 8 MiB.
DEFAULT_CHUNK_NBYTES = 8 << 20


class BufferRing:
    """``count`` reusable host buffers of ``chunk_nbytes`` bytes each.

    Buffers are allocated lazily on first use and then reused round-robin; a
    piece handed out by :meth:`next` stays valid until ``count`` further calls.
    Not thread-safe.
    """

    def __init__(self, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES, count: int = 2) -> None:
        if chunk_nbytes <= 0 or count <= 0:
            raise LayoutError(
                f"chunk_nbytes and count must be > 0, got {chunk_nbytes} and {count}"
            )
        self.chunk_nbytes = chunk_nbytes
        self.count = count
        self._buffers: List[bytearray] = []
        self._next = 0

    @property
    def allocated_nbytes(self) -> int:
        """Host bytes held by the ring so far."""
        return sum(len(b) for b in self._buffers)

    def next(self) -> memoryview:
        """The next buffer, as a writable view of ``chunk_nbytes`` bytes."""
        if len(self._buffers) < self.count:
            self._buffers.append(bytearray(self.chunk_nbytes))
            buf = self._buffers[-1]
        else:
            buf = self._buffers[self._next]
            self._next = (self._next + 1) % self.count
        return memoryview(buf)


class Source(ABC):
    """Payload of one buffer: a known size, a cheap prefix, pieces on demand.

    Subclasses are cheap to construct: nothing is read or copied until
    :meth:`pieces` is iterated.
    """

    #: Size in bytes, fixed when the source is created.
    nbytes: int

    #: A :class:`~ptdstream.fingerprint.Fingerprint` the bytes must still have
    #: when they are written (set where the data was digested before, e.g. when
    #: executorch's emitter hashed a constant); the writer raises
    #: ``IntegrityError`` and publishes nothing when they differ.
    expected_fingerprint = None

    @abstractmethod
    def describe(self) -> str:
        """Where the bytes come from, for error messages ("file /a/b offset 0")."""

    @abstractmethod
    def prefix(self, nbytes: int = 32) -> bytes:
        """The first ``min(nbytes, self.nbytes)`` bytes."""

    @abstractmethod
    def pieces(self, ring: BufferRing) -> Iterator[memoryview]:
        """Yield the payload in order as pieces of at most ``ring.chunk_nbytes``.

        Each piece is valid until the next one is requested. The last piece may
        be shorter. The pieces add up to exactly :attr:`nbytes`.

        Raises:
            IntegrityError: the source no longer holds :attr:`nbytes` bytes.
        """

    def same_content(self, other: "Source") -> Optional[bool]:
        """Decide equality with ``other`` without the host digest, when this kind of
        source can (CUDA sources compare on the device); ``None`` if it cannot."""
        return None

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.nbytes} bytes: {self.describe()}>"


class MemorySource(Source):
    """Bytes, bytearray or any C-contiguous buffer, read in place (no copy).

    The caller must not mutate the buffer between plan and write; a change of
    content is caught by the digest check when the buffer is a dedup candidate,
    and by the prefix check otherwise.
    """

    def __init__(self, data, label: str = "bytes") -> None:
        view = memoryview(data)
        if not view.c_contiguous:
            raise LayoutError(f"{label}: buffer is not C-contiguous")
        self._view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self.nbytes = self._view.nbytes
        self._label = label

    def describe(self) -> str:
        return self._label

    def prefix(self, nbytes: int = 32) -> bytes:
        return bytes(self._view[:nbytes])

    def pieces(self, ring: BufferRing) -> Iterator[memoryview]:
        if self._view.nbytes != self.nbytes:
            raise IntegrityError(
                f"{self._label}: size changed from {self.nbytes} to {self._view.nbytes} bytes"
            )
        step = ring.chunk_nbytes
        for start in range(0, self.nbytes, step):
            yield self._view[start : start + step]


class FileRangeSource(Source):
    """``length`` bytes of the file at ``path`` from byte ``offset``, read with pread.

    Pieces are read into the ring's buffers; the file's pages are dropped from
    the page cache after each piece (``POSIX_FADV_DONTNEED``), so a large source
    does not fill the cache.

    Raises:
        LayoutError: at construction, when the range lies beyond the file's end.
        IntegrityError: while reading, when the file has shrunk (names the file
            and the offset where data ran out).
    """

    def __init__(self, path: str, offset: int = 0, length: Optional[int] = None) -> None:
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise LayoutError(
                f"file {self.path}: range offset {offset} + length {length} lies beyond "
                f"its size {size} bytes"
            )
        self.offset = offset
        self.nbytes = length

    def describe(self) -> str:
        return f"file {self.path} offset {self.offset}"

    def prefix(self, nbytes: int = 32) -> bytes:
        with open(self.path, "rb") as f:
            return os.pread(f.fileno(), min(nbytes, self.nbytes), self.offset)

    def pieces(self, ring: BufferRing) -> Iterator[memoryview]:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < self.nbytes:
                buf = ring.next()
                want = min(len(buf), self.nbytes - done)
                got = pread_exact(fd, buf[:want], self.offset + done)
                if got < want:
                    raise IntegrityError(
                        f"file {self.path}: ended at offset {self.offset + done + got}, "
                        f"expected {self.nbytes} bytes from offset {self.offset}"
                    )
                yield buf[:want]
                drop_pages(fd, self.offset + done, want)
                done += want
        finally:
            os.close(fd)


def pread_exact(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at file ``offset`` (bytes), looping on short reads.

    Returns the bytes read: ``len(view)``, or fewer when the file ends first
    (callers turn that into their own error, naming file and offset).
    """
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


class TensorSource(Source):
    """A CPU tensor's bytes, read in place from its storage (no copy, bf16 included).

    The bytes are those upstream's ``_named_data_store._tensor_to_bytes`` gives:
    the tensor's elements in memory order. A contiguous tensor (any storage
    offset) is viewed directly. A non-contiguous tensor is accepted only when it
    is dense and fills its whole storage from offset 0 (``channels_last``, for
    example): upstream writes the whole storage for those, and so does this
    source. Other non-contiguous tensors (slices, expanded views) raise, since
    upstream would write the whole underlying storage, not the tensor.

    Raises:
        LayoutError: a non-contiguous tensor that is not dense over its whole
            storage ("call .contiguous()").
        IntegrityError: at write time, when the storage was freed or resized
            after the tensor was added.
    """

    def __init__(self, tensor, label: str = "tensor") -> None:
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"{label}: expected a torch.Tensor, got {type(tensor)}")
        if tensor.device.type != "cpu":
            raise LayoutError(
                f"{label}: tensor is on {tensor.device}; use ptdstream.cuda.CudaTensorSource"
            )
        self._tensor = tensor.detach()
        self._label = label
        self._whole_storage = not self._tensor.is_contiguous()
        if self._whole_storage and not _fills_storage(self._tensor):
            raise LayoutError(
                f"{label}: tensor with shape {tuple(tensor.shape)} and strides "
                f"{tuple(tensor.stride())} is not contiguous; call .contiguous() on it "
                "before adding it"
            )
        self.nbytes = self._expected_nbytes()

    def _expected_nbytes(self) -> int:
        if self._whole_storage:
            return self._tensor.untyped_storage().nbytes()
        return self._tensor.numel() * self._tensor.element_size()

    def describe(self) -> str:
        t = self._tensor
        return f"{self._label} {str(t.dtype).replace('torch.', '')}{list(t.shape)}"

    def _view(self) -> memoryview:
        """A read-only view of the bytes, made from the storage's address.

        ``Tensor.numpy()`` would mark the caller's storage non-resizable for good;
        a ctypes view does not. The tensor reference held by this source keeps
        the storage alive; its size is checked here, right before reading.
        """
        import ctypes

        t = self._tensor
        storage = t.untyped_storage()
        start = self._start()
        needed = start + self.nbytes
        if storage.nbytes() < needed:
            raise IntegrityError(
                f"{self.describe()}: its storage holds {storage.nbytes()} bytes, "
                f"{needed} needed; was it freed or resized after it was added?"
            )
        if self.nbytes == 0:
            return memoryview(b"")
        array = (ctypes.c_ubyte * self.nbytes).from_address(self._address())
        return memoryview(array).cast("B").toreadonly()

    def _start(self) -> int:
        """Offset (bytes) of the first byte in the storage."""
        t = self._tensor
        return 0 if self._whole_storage else t.storage_offset() * t.element_size()

    def _address(self) -> int:
        """Address of the first byte, where the storage is now."""
        return self._tensor.untyped_storage().data_ptr() + self._start()

    def prefix(self, nbytes: int = 32) -> bytes:
        return bytes(self._view()[:nbytes])

    def pieces(self, ring: BufferRing) -> Iterator[memoryview]:
        view = self._view()
        step = ring.chunk_nbytes
        for start in range(0, self.nbytes, step):
            yield view[start : start + step]


def _fills_storage(t) -> bool:
    if t.storage_offset() != 0:
        return False
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return False
    # Dense and non-overlapping: sorting the strides must give a contiguous layout.
    dims = sorted(range(t.dim()), key=lambda d: t.stride(d))
    expected = 1
    for d in dims:
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def as_source(data, label: str = "data") -> Source:
    """Wrap anything ptdstream can read into a :class:`Source`.

    Accepts a :class:`Source` (returned as is), ``bytes``/``bytearray``/
    ``memoryview``, a CPU or CUDA ``torch.Tensor``, and executorch's
    ``FileBackedData``.

    Raises:
        TypeError: any other type, with upstream's text
            ("Unsupported named data type: ...").
    """
    if isinstance(data, Source):
        return data
    if isinstance(data, (bytes, bytearray, memoryview)):
        return MemorySource(data, label)
    inner = getattr(data, "source", None)
    if isinstance(inner, Source) and getattr(type(data), "_ptdstream_source_backed", False):
        return inner  # ptdstream.interop.SourceBackedData: the fast path
    from . import _upstream

    path = _upstream.file_backed_path(data)
    if path is not None:
        return FileRangeSource(path, 0, len(data))
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is not None and isinstance(data, torch.Tensor):
        if data.device.type == "cuda":
            from .cuda import CudaTensorSource

            return CudaTensorSource(data, label)
        return TensorSource(data, label)
    raise TypeError(f"Unsupported named data type: {type(data)}")
