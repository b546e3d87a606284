"""One tensor loaded from a file (or a source) to a device in pieces, through a staging ring.

:func:`load_to_device` reads the tensor's file range with ``preadv`` into the
reused pinned host ring (:class:`~ptdstream.sources.cuda.PinnedRing`, 4 x 8 MiB,
one per device for the process: :meth:`PinnedStaging.get`) and copies each
piece asynchronously to its slice of the new device tensor on the ring's stream
while the next piece is read; a buffer is refilled only once its last copy is
done. Each piece's pages are dropped behind the read
(:func:`~ptdstream.system.pagecache.drop_read`): the caller
(:mod:`ptdstream.weightless.to_device`) reads each weight once (its device copy
serves every method and the save), so cached pages would only fill the page
cache. A tensor stored in another float dtype is converted per piece on the
host into the pinned buffer with the copy kernel
:mod:`ptdstream.weightless.convert` uses (element by element: the bytes of the
converted copy the binding made and of ``.to(dtype)``, identical for every
non-NaN value; a NaN stays a NaN, its sign and payload bits may differ, as they
do between torch's own conversions on different thread counts: see there). A tensor the file cannot give directly (a
``torch.save`` archive of the other byte order; a DCP tensor's converted copy)
is read from a :class:`~ptdstream.sources.Source` instead (its mapping, each
piece paged out: :class:`~ptdstream.sources.mapped.MappedTensorSource`). The
device tensor has the given dtype, shape and strides, storage offset 0: for a
dense tensor, the bytes of ``tensor.to(device)`` (converted: as above). :class:`HostStaging` is the
same interface over plain host buffers with synchronous copies (a CPU target).

Checks: the file's identity (device, inode, size, modification and change
time) given in the :class:`DeviceLoad`, compared with the open file's before
and after the read, and every read's length: ``IntegrityError`` naming the
file, the key and (short read) the offset; a failed load returns nothing.
The file stands for the bound tensor's memory only while no page of it is a
private copy: the caller reads a tensor written in place from its memory
instead, and a write while the file is read (``DeviceLoad.memory`` has a
private copy after the load) is refused with ``IntegrityError`` naming the key:
the same class as writing a tensor while it is saved.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..defaults import CHUNK_NBYTES
from ..errors import IntegrityError
from ..sources.base import BufferRing, FileIdentity, Source
from ..system.files import open_input_fd
from ..system.pagecache import private_copies

__all__ = ["DeviceLoad", "HostStaging", "PinnedStaging", "itemsize", "load_to_device"]

_lock = threading.Lock()
_stagings: dict[tuple[str, int], PinnedStaging] = {}


class HostStaging:
    """The staging ring's interface over plain host buffers, with synchronous
    copies to tensors made on ``device`` (a CPU target; a test's stand-in for
    :class:`PinnedStaging`). ``count`` buffers of ``chunk_nbytes`` bytes."""

    def __init__(self, chunk_nbytes: int = CHUNK_NBYTES, count: int = 2, device: str = "cpu") -> None:
        import torch

        self.chunk_nbytes = chunk_nbytes
        self.device = torch.device(device)
        self.buffers = [torch.empty(chunk_nbytes, dtype=torch.uint8) for _ in range(count)]

    def empty(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: Any) -> Any:
        """The destination tensor (uninitialized)."""
        import torch

        return torch.empty_strided(shape, stride, dtype=dtype, device=self.device)

    def slot(self, i: int) -> Any:
        """Buffer of piece ``i``, free to be filled."""
        return self.buffers[i % len(self.buffers)]

    def send(self, i: int, dst: Any, nbytes: int) -> None:
        """Copy the first ``nbytes`` of piece ``i``'s buffer into ``dst`` (1-D uint8)."""
        dst.copy_(self.slot(i)[:nbytes])

    def start(self) -> None:
        """Before the first piece of a tensor."""

    def finish(self) -> None:
        """After the last piece: every copy complete."""


class PinnedStaging(HostStaging):
    """:class:`~ptdstream.sources.cuda.PinnedRing` buffers (pinned, ``count`` x
    ``chunk_nbytes``) and its stream: each piece's host-to-device copy is queued
    on the ring's stream, and a buffer is refilled only once its last copy is done."""

    def __init__(self, device: Any, chunk_nbytes: int = CHUNK_NBYTES, count: int = 4) -> None:
        from ..sources.cuda import PinnedRing

        self.chunk_nbytes = chunk_nbytes
        self.device = device
        self.ring = PinnedRing(device, chunk_nbytes, count)
        self.buffers = self.ring.buffers

    @staticmethod
    def get(device: Any, chunk_nbytes: int = CHUNK_NBYTES) -> PinnedStaging:
        """The process's staging ring for ``device`` (made once, never freed)."""
        key = (str(device), chunk_nbytes)
        with _lock:
            if key not in _stagings:
                _stagings[key] = PinnedStaging(device, chunk_nbytes)
            return _stagings[key]

    def slot(self, i: int) -> Any:
        s = i % len(self.buffers)
        self.ring.events[s].synchronize()  # its previous copy (an event never recorded returns at once)
        return self.buffers[s]

    def send(self, i: int, dst: Any, nbytes: int) -> None:
        import torch

        s = i % len(self.buffers)
        with torch.cuda.stream(self.ring.stream):
            dst.copy_(self.buffers[s][:nbytes], non_blocking=True)
            self.ring.events[s].record(self.ring.stream)

    def start(self) -> None:
        import torch

        self.ring.stream.wait_stream(torch.cuda.current_stream(self.device))  # the destination's allocation

    def finish(self) -> None:
        self.ring.stream.synchronize()


@dataclass(frozen=True)
class DeviceLoad:
    """Where one bound constant's bytes are, and the device tensor to make.

    ``shape``, ``stride`` (elements, dense) and ``dtype``: the device tensor's
    (the bound tensor's). Read from ``path`` at file ``offset`` (bytes; the
    tensor stored there as ``stored``, converted per piece when it differs from
    ``dtype``; ``identity``: the file's when the context opened it), or else
    from ``source``'s pieces (already in ``dtype``). ``label`` names file and key.
    ``memory``: ``(address, nbytes)`` of the bound tensor whose bytes the file
    (or a source reading the file) stands for, in its ``MAP_PRIVATE`` mapping:
    no page of it may have become a private copy (a write) by the end of the load.
    """

    label: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any
    path: str | None = None
    offset: int = 0
    stored: Any = None
    identity: FileIdentity | None = None
    source: Source | None = None
    memory: tuple[int, int] | None = None


def itemsize(dtype: Any) -> int:
    """Bytes per element of torch ``dtype``."""
    return int(dtype.itemsize)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _host_view(tensor: Any) -> memoryview:
    """A writable byte view of a host uint8 tensor."""
    return memoryview(tensor.numpy()).cast("B")


def _check_identity(fd: int, load: DeviceLoad, when: str) -> None:
    now = FileIdentity.of(os.fstat(fd))
    if load.identity is not None and now != load.identity:
        raise IntegrityError(
            f"{load.label}: checkpoint file {load.path} changed after weights_from opened it (device, inode, size, "
            f"modification and change time {tuple(load.identity)} then, {tuple(now)} now), {when}, when it was "
            "loaded to the device: nothing loaded; a checkpoint must not change until the save: export again "
            "from an unchanged checkpoint")


class _Slots(BufferRing):
    """The ring :func:`~ptdstream.sources.file.pread_pieces` reads into: piece ``i``
    into staging slot ``i`` (or, when converting, into one scratch buffer of the
    stored dtype), ``nbytes`` (whole elements) at a time; no buffer of its own."""

    def __init__(self, staging: HostStaging, nbytes: int, scratch: Any = None) -> None:
        super().__init__(nbytes, count=1)
        self.staging, self.nbytes, self.scratch, self.i = staging, nbytes, scratch, 0

    def next(self) -> memoryview:
        buf = self.scratch if self.scratch is not None else self.staging.slot(self.i)
        self.i += 1
        return _host_view(buf)[: self.nbytes]


def _file_pieces(load: DeviceLoad, path: str, staging: HostStaging) -> Iterator[tuple[int, int]]:
    """Fill staging slot ``i`` with piece ``i`` of ``path`` (converted) and yield ``(i, nbytes)``."""
    from ..sources.file import pread_pieces

    stored = load.stored if load.stored is not None else load.dtype
    size_in, size_out = itemsize(stored), itemsize(load.dtype)
    numel = _numel(load.shape)
    per = max(1, staging.chunk_nbytes // max(size_in, size_out))  # elements per piece
    scratch = None
    if stored != load.dtype:
        import torch

        scratch = torch.empty(per * size_in, dtype=torch.uint8)

    def ended(at: int) -> IntegrityError:
        return IntegrityError(
            f"{load.label}: checkpoint file {load.path} ended at offset {at}: the tensor needs "
            f"{numel * size_in} bytes from offset {load.offset} (to offset {load.offset + numel * size_in}); "
            "the file was truncated: export again from a complete checkpoint")

    fd = open_input_fd(path)
    try:
        _check_identity(fd, load, "before it was read")
        for i, piece in enumerate(pread_pieces(fd, load.offset, numel * size_in,
                                               _Slots(staging, per * size_in, scratch), ended)):
            k = len(piece) // size_in
            if scratch is not None:
                # copy_ casts as .to(dtype) does (convert.py's kernel): the bytes of the converted copy
                staging.slot(i)[: k * size_out].view(load.dtype).copy_(scratch[: len(piece)].view(stored))
            yield i, k * size_out
        _check_identity(fd, load, "while it was read")
    finally:
        os.close(fd)


def _source_pieces(source: Source, staging: HostStaging) -> Iterator[tuple[int, int]]:
    i = 0
    step = staging.chunk_nbytes
    for piece in source.pieces(BufferRing(step, count=1)):
        view = memoryview(piece).cast("B")
        for start in range(0, len(view), step):
            n = min(step, len(view) - start)
            _host_view(staging.slot(i))[:n] = view[start : start + n]
            yield i, n
            i += 1


def load_to_device(load: DeviceLoad, staging: HostStaging) -> Any:
    """A new tensor on ``staging.device`` holding ``load``'s bytes (see the module
    docstring): ``load.dtype``, ``load.shape``, ``load.stride``, storage offset 0.

    Host memory: ``staging``'s buffers (reused) and, when converting, one piece
    of the stored dtype. Device memory: the tensor.

    Raises:
        IntegrityError: the file changed since ``load.identity`` (before or
            while it was read), a read came short (names file, key, offset),
            or a source gave another number of bytes than the tensor needs,
            or ``load.memory`` had a private copy (was written) after the load.
        OSError: the file cannot be opened or read.
    """
    import torch

    nbytes = _numel(load.shape) * itemsize(load.dtype)
    dst = staging.empty(load.shape, load.stride, load.dtype)
    flat = torch.empty(0, dtype=torch.uint8, device=dst.device).set_(dst.untyped_storage(), 0, (nbytes,), (1,))
    if load.path is not None:
        pieces = _file_pieces(load, load.path, staging)
    elif load.source is not None:
        pieces = _source_pieces(load.source, staging)
    else:
        raise ValueError(f"{load.label}: a DeviceLoad needs a path or a source")
    staging.start()
    done = 0
    try:
        for i, n in pieces:
            if done + n > nbytes:
                raise IntegrityError(f"{load.label}: its source gave more than the {nbytes} bytes the tensor needs")
            staging.send(i, flat[done : done + n], n)
            done += n
    finally:
        staging.finish()
    if done != nbytes:
        raise IntegrityError(f"{load.label}: its source gave {done} bytes, the tensor needs {nbytes}")
    if load.memory is not None and private_copies(*load.memory) is not False:
        address, size = load.memory
        read = load.path if load.path is not None else load.source.describe() if load.source is not None else "?"
        raise IntegrityError(
            f"{load.label}: the bound tensor (memory {address:#x}, {size} bytes) was written to while it was loaded "
            f"to the device from {read}: nothing loaded; a bound weight must not "
            "change while it is loaded, as while it is saved: lower again without writing it meanwhile")
    return dst
