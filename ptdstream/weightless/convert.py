"""Checkpoint tensors converted piece by piece into temporary files, memory-mapped back.

A checkpoint tensor stored in another float dtype than the export's (float32,
float16, bfloat16, to one another), or one that is loaded rather than mapped
(DCP), is bound to a copy on disk: :meth:`ConvertDir.convert` streams the
checkpoint's :class:`~ptdstream.sources.Source` of the key in pieces
(:data:`~ptdstream.defaults.CHUNK_NBYTES`), converts each piece with torch
(``piece.to(dtype)``: element by element, so the bytes are those of the whole
tensor's ``.to(dtype)``: identical for every non-NaN value; a NaN stays a NaN,
its sign and payload bits may differ, as they do between torch's own
conversions on different thread counts: torch's CPU cast gives a NaN other bits
in its vectorized loop than in its scalar tail, e.g. float16 ``0xfe01`` to
float32 ``0xffc02000`` vectorized, ``0x7fffffff`` scalar, and splits a tensor
among threads at ``ceil(n / threads)`` elements, so which elements take which
loop depends on the piece and the thread count), and writes it to a new file in the folder, with
bounded writeback (:class:`~ptdstream.system.writeback.WritebackWindows`), its
pages dropped once on disk. The file is then mapped back (``MAP_PRIVATE``,
never written) and viewed as the export's dtype, shape and the checkpoint's dim
order: every later stage reads it as it reads a mapped checkpoint (the
emitter's and XNNPACK's references page it out piece by piece).

Files: created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 in the
folder (a fresh :func:`tempfile.mkdtemp` one unless the caller names one), and
removed as soon as they are mapped back: the mapping keeps the bytes (and the
disk space) until the tensor is dropped, and no file is left behind even if
the process is killed then (a kill while one is written leaves that one).
:meth:`ConvertDir.close` removes what is left of the files it created (and the
folder it created, if nothing else is in it), never anything else.

Host memory: one piece of the source (the ring, 8 MiB) and its converted copy
(up to 2 pieces, bfloat16 -> float32), both allocated once per folder and
reused by every conversion, plus what the source
itself holds (a DCP tensor is loaded whole, one at a time: see
:mod:`ptdstream.sources.checkpoint`); page cache: a few writeback windows.
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import tempfile
from typing import TYPE_CHECKING

from ..defaults import CHUNK_NBYTES, WINDOW_NBYTES
from ..errors import IntegrityError
from ..sources.base import BufferRing, Source
from ..system.files import pwrite_all
from ..system.pagecache import FileMapping, drop_pages
from ..system.writeback import WritebackWindows

if TYPE_CHECKING:
    import torch

__all__ = ["CONVERTIBLE", "FAULT_AROUND_NBYTES", "ConvertDir", "RowReader", "convertible"]

#: The dtypes converted to one another (by name: torch is imported lazily).
CONVERTIBLE = ("float32", "float16", "bfloat16")


def convertible(stored: torch.dtype, wanted: torch.dtype) -> bool:
    """Whether a ``stored`` checkpoint tensor is converted to ``wanted``: both
    among :data:`CONVERTIBLE` (the same dtype: a copy)."""
    return str(stored).removeprefix("torch.") in CONVERTIBLE and str(wanted).removeprefix("torch.") in CONVERTIBLE


def _strides(shape: tuple[int, ...], dim_order: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides (elements) of ``shape`` laid out in ``dim_order`` (outermost first)."""
    strides = [0] * len(shape)
    step = 1
    for d in reversed(dim_order):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


class ConvertDir:
    """The folder converted tensors are written to, and the files made there.

    ``folder``: an existing folder (its files system takes the bytes; on a
    tmpfs they stay in memory), or None for a fresh ``tempfile.mkdtemp()``
    removed by :meth:`close`. Not thread-safe: one binding at a time.

    Raises:
        NotADirectoryError: ``folder`` is not an existing folder (named).
    """

    def __init__(self, folder: str | os.PathLike[str] | None = None) -> None:
        if folder is None:
            self.folder = tempfile.mkdtemp(prefix="ptdstream-convert-")
            self._own = True
        else:
            self.folder = os.fspath(folder)
            if not os.path.isdir(self.folder):
                raise NotADirectoryError(f"convert_dir {self.folder}: not an existing folder: create it, or "
                                         "leave convert_dir out (a temporary folder)")
            self._own = False
        self.files: list[str] = []
        self._names = itertools.count()
        # one ring and one output buffer, reused by every conversion (memory
        # freed and allocated again per piece is not given back at once)
        self._ring: BufferRing | None = None
        self._out: torch.Tensor | None = None

    def _buffers(self, chunk_nbytes: int, out_nbytes: int) -> tuple[BufferRing, torch.Tensor]:
        import torch

        if self._ring is None or self._ring.chunk_nbytes != chunk_nbytes:
            self._ring = BufferRing(chunk_nbytes, count=1)
        if self._out is None or self._out.numel() < out_nbytes:
            self._out = torch.empty(out_nbytes, dtype=torch.uint8)
        return self._ring, self._out

    def _create(self) -> tuple[str, int]:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        while True:
            path = os.path.join(self.folder, f".ptdstream-convert-{next(self._names)}-{secrets.token_hex(4)}")
            try:
                fd = os.open(path, flags, 0o600)
            except FileExistsError:
                continue
            except OSError as e:
                raise OSError(e.errno, f"convert_dir {self.folder}: cannot create a file there: "
                                       f"{e.strerror}") from e
            self.files.append(path)
            return path, fd

    def convert(self, source: Source, stored: torch.dtype, dtype: torch.dtype, shape: tuple[int, ...],
                dim_order: tuple[int, ...], label: str, chunk_nbytes: int = CHUNK_NBYTES) -> torch.Tensor:
        """``source``'s bytes (a ``stored`` tensor of ``shape`` in ``dim_order``),
        converted to ``dtype`` into a new file of the folder, mapped back;
        read in pieces of ``chunk_nbytes`` (an element split between two pieces
        is joined).

        Returns a tensor of ``dtype`` and ``shape`` (dense, in ``dim_order``)
        over the file's private mapping (the file removed already); its
        storage is exactly the tensor.

        Raises:
            OSError: creating or writing the file failed (ENOSPC: names the folder
                and the offset); the file is removed.
            IntegrityError: the source does not hold ``shape``'s bytes (no file
                made), or gave another number of bytes than it said (the file
                is removed). Errors of the source pass through.
        """
        import torch

        numel = 1
        for s in shape:
            numel *= s
        size_in = torch.empty((), dtype=stored).element_size()
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if source.nbytes != numel * size_in:
            raise IntegrityError(f"{label}: {source.describe()} holds {source.nbytes} bytes, a {stored} tensor of "
                                 f"shape {list(shape)} needs {numel * size_in}; nothing converted")
        path, fd = self._create()
        try:
            self._write(fd, source, stored, dtype, size_in, nbytes, label, chunk_nbytes)
            if nbytes:
                flat = torch.frombuffer(mmap.mmap(fd, nbytes, access=mmap.ACCESS_COPY), dtype=torch.uint8)
            else:
                flat = torch.empty(0, dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            self.remove(path)
            raise
        os.close(fd)
        self.remove(path)  # the mapping keeps the bytes
        return flat.view(dtype).as_strided(shape, _strides(shape, dim_order))

    def _write(self, fd: int, source: Source, stored: torch.dtype, dtype: torch.dtype, size_in: int,
               nbytes: int, label: str, chunk_nbytes: int) -> None:
        import torch

        size_out = torch.empty((), dtype=dtype).element_size()
        ring, out_buffer = self._buffers(chunk_nbytes, (chunk_nbytes // size_in + 1) * size_out)
        writeback = WritebackWindows(fd, WINDOW_NBYTES)
        done = read = 0
        carry = b""  # the bytes of an element split between two pieces
        try:
            for piece in source.pieces(ring):
                view = memoryview(piece).cast("B")
                read += len(view)
                if read > source.nbytes:
                    raise IntegrityError(f"{label}: {source.describe()} gave more than the {source.nbytes} "
                                         "bytes it said, when converted")
                if carry or view.readonly:  # torch.frombuffer wants writable memory
                    view = memoryview(bytearray(carry) + view)
                whole = len(view) - len(view) % size_in
                carry = bytes(view[whole:])
                if not whole:
                    continue
                if stored == dtype:
                    out = view[:whole]
                else:
                    # copy_ casts as .to(dtype) does (the same kernel), into the reused buffer
                    converted = out_buffer[: whole // size_in * size_out].view(dtype)
                    converted.copy_(torch.frombuffer(view[:whole], dtype=stored))
                    out = converted.view(torch.uint8).numpy().data.cast("B")
                try:
                    pwrite_all(fd, out, done)
                except OSError as e:
                    at = getattr(e, "offset", done)
                    raise OSError(e.errno, f"{label}: writing its {dtype} copy to {self.folder} at offset "
                                           f"{at} failed: {e.strerror}") from e
                writeback.written(done, len(out))
                done += len(out)
            writeback.flush()
            writeback.close()
            os.fdatasync(fd)
        finally:
            writeback.close()
            drop_pages(fd, 0, done)
        if read != source.nbytes or done != nbytes:
            raise IntegrityError(f"{label}: {source.describe()} gave {read} bytes, not the {source.nbytes} it "
                                 "said, when converted")

    def remove(self, path: str) -> None:
        """Remove ``path``, one of :attr:`files` (idempotent on the disk)."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.files.remove(path)

    def close(self) -> None:
        """Remove every file made here (and the folder, if this made it) and free
        the buffers; idempotent. Tensors mapped from the files stay valid (the
        mappings keep the bytes)."""
        self._ring = self._out = None
        for path in list(self.files):
            self.remove(path)
        if self._own:
            try:
                os.rmdir(self.folder)  # only when empty: what others put there stays
            except FileNotFoundError:
                pass
            except OSError:
                return
            self._own = False


#: How far past a tensor's ends its reads may have mapped pages: the kernel maps a window around a
#: faulting page (``fault_around_bytes``) or a whole large folio of the page cache (2 MiB on x86-64).
FAULT_AROUND_NBYTES = 2 << 20


def _extent_nbytes(tensor: torch.Tensor) -> int:
    """The bytes from a non-empty tensor's first element to the end of its last (any strides >= 0)."""
    return (1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))) * tensor.element_size()


class RowReader:
    """Rows of a checkpoint tensor (memory-mapped, or a converted copy) read into
    new tensors of ``dtype``, the pages of each band handed back once read.

    ``tensor``: a CPU tensor over a file mapping (its first dim the rows; any
    dim order). :meth:`read` gives rows ``[r0, r1)`` as a new contiguous tensor
    of ``dtype`` (``copy_``: the cast of ``.to(dtype)``, as :meth:`ConvertDir.convert`).
    """

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype, label: str = "tensor") -> None:
        from ..system.pagecache import file_mapping

        self.tensor: torch.Tensor | None = tensor
        self.dtype = dtype
        self.label = label  #: names the tensor in errors (the checkpoint key)
        storage = tensor.untyped_storage()
        self._mapping = file_mapping(storage.data_ptr(), storage.nbytes()) if storage.nbytes() else None

    def read(self, r0: int, r1: int, device: str | torch.device | None = None) -> torch.Tensor:
        """Rows ``[r0, r1)`` in ``dtype`` on ``device`` (None: the CPU), a new tensor.

        Raises:
            ValueError: the reader is closed, or the rows are out of range.
            IntegrityError: the mapped file was truncated under the rows (read, it
                would kill the process with SIGBUS).
        """
        import torch

        from ..system.pagecache import release_mapped

        tensor = self.tensor
        if tensor is None:
            raise ValueError("RowReader.read after close()")
        rows = tensor.shape[0] if tensor.dim() else 1
        if not 0 <= r0 <= r1 <= rows:
            raise ValueError(f"rows [{r0}, {r1}) of a tensor of {rows} rows")
        part = tensor[r0:r1] if tensor.dim() else tensor
        if self._mapping is not None and part.numel():
            self._check_present(self._mapping, part, r0, r1)
        out = torch.empty(tuple(part.shape), dtype=self.dtype, device=device if device is not None else "cpu")
        out.copy_(part)
        if self._mapping is not None and part.is_contiguous() and part.numel():
            release_mapped(part.data_ptr(), part.numel() * part.element_size(),
                           (self._mapping.start, self._mapping.stop))
        return out

    def _check_present(self, m: FileMapping, part: torch.Tensor, r0: int, r1: int) -> None:
        """Refuse rows the mapped file no longer holds (truncated since it was mapped;
        a file replaced or removed keeps the old inode's bytes in the mapping)."""
        from ..sources.mapped import same_inode_now

        offset = m.offset + (part.data_ptr() - m.start)
        needed = offset + _extent_nbytes(part)
        now = same_inode_now(m.path, m.inode)
        if now is not None and now.size < needed:
            raise IntegrityError(
                f"{self.label}: rows [{r0}, {r1}) at offset {offset:,} of checkpoint file {m.path}: the file was "
                f"truncated after it was mapped (needs {needed:,} bytes, has {now.size:,}); nothing is "
                "quantized from it")

    def close(self) -> None:
        """Hand back the pages the reads mapped around the tensor (a page fault maps a
        window around its page, up to :data:`FAULT_AROUND_NBYTES` past either end: the
        neighbours' pages, which no band of this tensor releases), then drop the
        tensor (a converted copy's mapping goes with it); idempotent."""
        from ..system.pagecache import release_mapped

        tensor = self.tensor
        if tensor is not None and self._mapping is not None and tensor.numel():
            start = tensor.data_ptr() - FAULT_AROUND_NBYTES
            release_mapped(start, _extent_nbytes(tensor) + 2 * FAULT_AROUND_NBYTES,
                           (self._mapping.start, self._mapping.stop))
        self.tensor = None
