"""A tensor moved out of memory: its bytes written to a nameless temp file and memory-mapped back.

:func:`mapped_copy` is how a tensor computed while exporting (a constant that
``constant_prop_pass`` folds from bound weights) stops holding memory: the
returned tensor has the same dtype, shape, strides, storage offset and storage
size, and its storage is a shared mapping of a file no one can open by name
(``O_TMPFILE`` where the file system has it, else a created and at once removed
file). Its pages are read back only when something reads it, and a reader that
drops pages (:class:`~ptdstream.sources.mapped.MappedTensorSource`: the
emitter's hash, the save) keeps about one piece resident. The file vanishes
with the last tensor that maps it, or when the process ends.

:class:`RowFiles` builds tensors the same way band by band (the rows of each
band appended to its file): a weight quantized in bands of rows.

On a tmpfs the copied bytes stay in memory: give a folder on disk.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import tempfile
from typing import Any

from ..system.files import pwrite_all

__all__ = ["RowFiles", "mapped_copy", "mapped_transpose"]


def _open_unlinked(folder: str) -> tuple[int, str | None]:
    """A read-write descriptor of a new nameless file in ``folder``, and the name
    to remove once it is mapped (None: it never had one).

    Raises:
        OSError: ``folder`` is missing, not a folder or not writable (named).
    """
    flag = getattr(os, "O_TMPFILE", 0)
    try:
        if flag:
            try:
                return os.open(folder, flag | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), 0o600), None
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EROFS):
                    raise
        fd, path = tempfile.mkstemp(prefix=".ptdstream-fold-", dir=folder)  # O_EXCL, 0600
    except OSError as e:
        raise OSError(e.errno, f"temp folder {folder}: cannot create a temp file there: {e.strerror}") from e
    return fd, path


def mapped_copy(tensor: Any, folder: str) -> Any:
    """``tensor``'s storage written to a nameless file in ``folder`` and mapped back.

    ``tensor``: a CPU tensor with a storage (not empty). Returns a tensor of the
    same dtype, shape, strides and storage offset over a storage of the same
    size holding the same bytes (``requires_grad`` False). ``tensor`` itself is
    not changed; drop it to free its memory.

    Raises:
        ValueError: ``tensor`` is not on the CPU or its storage is empty.
        OSError: the file cannot be created, written (ENOSPC names the folder) or mapped.
    """
    import torch

    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if tensor.device.type != "cpu" or nbytes == 0:
        raise ValueError(f"mapped_copy needs a CPU tensor with a storage, got {tensor.device} with {nbytes} bytes")
    fd, name = _open_unlinked(folder)
    try:
        _write(fd, memoryview((ctypes.c_char * nbytes).from_address(storage.data_ptr())).cast("B"), 0, folder)
        mapped = _map_back(fd, name, nbytes)
    finally:
        os.close(fd)
        if name is not None:
            os.unlink(name)
    return torch.empty(0, dtype=tensor.dtype).set_(mapped, tensor.storage_offset(), tensor.shape, tensor.stride())


def _write(fd: int, view: memoryview, offset: int, folder: str) -> None:
    try:
        pwrite_all(fd, view, offset)
    except OSError as e:
        raise OSError(e.errno, f"temp folder {folder}: cannot write {len(view):,} bytes there: "
                               f"{e.strerror}") from e


def _map_back(fd: int, name: str | None, nbytes: int) -> Any:
    import torch

    return torch.UntypedStorage.from_file(name or f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)


def mapped_transpose(tensor: Any, folder: str, band_nbytes: int) -> Any:
    """``tensor.t().contiguous()`` written to a nameless file in ``folder`` in
    bands and mapped back, ``tensor`` never read whole into this process's RSS.

    ``tensor``: a 2-D contiguous CPU tensor (R, C). Returns a contiguous (C, R)
    tensor of the same dtype over a file mapping (``requires_grad`` False), the
    bytes of ``tensor.t().contiguous()``. Each band of about ``band_nbytes``
    output rows is filled from row pieces of about ``band_nbytes`` of
    ``tensor``; when ``tensor`` is a file mapping, each piece's pages are
    handed back once read (:func:`~ptdstream.system.pagecache.release_mapped`:
    the page cache keeps them for the next band). Resident: about two bands.

    Raises:
        ValueError: ``tensor`` is not a 2-D contiguous CPU tensor.
        OSError: the file cannot be created, written (ENOSPC names the folder) or mapped.
    """
    import torch

    from ..system.pagecache import file_mapping, release_mapped

    if tensor.device.type != "cpu" or tensor.dim() != 2 or not tensor.is_contiguous() or tensor.numel() == 0:
        raise ValueError(f"mapped_transpose needs a non-empty 2-D contiguous CPU tensor, got {tensor.device} "
                         f"{tuple(tensor.shape)} with strides {tensor.stride()}")
    rows, cols = tensor.shape
    item = tensor.element_size()
    mapping = file_mapping(tensor.data_ptr(), tensor.numel() * item)
    out_rows = max(1, band_nbytes // (rows * item))  # output rows per band
    piece_rows = max(1, band_nbytes // (cols * item))  # input rows per piece
    band_rows = min(out_rows, cols)
    # its own anonymous mapping, unmapped on return: a heap block this size would stay in the process
    memory = mmap.mmap(-1, band_rows * rows * item)
    band = torch.frombuffer(memory, dtype=tensor.dtype, count=band_rows * rows).view(band_rows, rows)
    part = view = None
    fd, name = _open_unlinked(folder)
    try:
        with torch.no_grad():
            for c0 in range(0, cols, out_rows):
                c1 = min(cols, c0 + out_rows)
                part = band[: c1 - c0]
                for r0 in range(0, rows, piece_rows):
                    r1 = min(rows, r0 + piece_rows)
                    part[:, r0:r1].copy_(tensor[r0:r1, c0:c1].t())
                    if mapping is not None:
                        release_mapped(tensor.data_ptr() + r0 * cols * item, (r1 - r0) * cols * item,
                                       (mapping.start, mapping.stop))
                view = memoryview((ctypes.c_char * (part.numel() * item)).from_address(part.data_ptr()))
                _write(fd, view.cast("B"), c0 * rows * item, folder)
        mapped = _map_back(fd, name, rows * cols * item)
    finally:
        os.close(fd)
        if name is not None:
            os.unlink(name)
        del band, part, view
        try:
            memory.close()
        except BufferError:  # a view still alive: the mapping goes with it
            pass
    return torch.empty(0, dtype=tensor.dtype).set_(mapped, 0, (cols, rows), (rows, 1))


class RowFiles:
    """Tensors built band by band: each band's rows appended to a nameless file
    in ``folder`` (one file a name), mapped back whole by :meth:`finish`.

    Every band of a name must be a contiguous CPU tensor of one dtype whose
    dims after the first are the same; its bytes go right after the band
    before. Resident: none of the bands (each is written as it comes).
    Use as a context manager: files not finished are closed on exit.

    Raises:
        ValueError: a band that is not contiguous, not on the CPU, or of
            another dtype or row shape than the first band of its name.
        OSError: a file cannot be created, written (ENOSPC names the folder) or mapped.
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        # name -> [fd, path or None, bytes written, rows, dtype, shape of a row]
        self._files: dict[str, list[Any]] = {}

    def append(self, name: str, band: Any) -> None:
        """Write ``band``'s rows after those of ``name`` appended before."""
        if band.device.type != "cpu" or not band.is_contiguous() or band.dim() == 0:
            raise ValueError(f"{name}: a band must be a contiguous CPU tensor of at least one dim, got "
                             f"{band.device} {tuple(band.shape)} with strides {band.stride()}")
        entry = self._files.get(name)
        if entry is None:
            fd, path = _open_unlinked(self.folder)
            entry = self._files[name] = [fd, path, 0, 0, band.dtype, tuple(band.shape[1:])]
        if (band.dtype, tuple(band.shape[1:])) != (entry[4], entry[5]):
            raise ValueError(f"{name}: a band of {band.dtype} {tuple(band.shape)} after bands of {entry[4]} rows "
                             f"{entry[5]}")
        nbytes = band.numel() * band.element_size()
        if nbytes:
            _write(entry[0], memoryview((ctypes.c_char * nbytes).from_address(band.data_ptr())).cast("B"), entry[2],
                   self.folder)
        entry[2] += nbytes
        entry[3] += band.shape[0]

    def finish(self) -> dict[str, Any]:
        """Each name's rows, one contiguous tensor over its file's shared mapping
        (``requires_grad`` False); the files are closed (and their names removed)."""
        import torch

        out = {}
        for name, (fd, path, nbytes, rows, dtype, row_shape) in list(self._files.items()):
            shape = (rows, *row_shape)
            if nbytes:
                mapped = _map_back(fd, path, nbytes)
                out[name] = torch.empty(0, dtype=dtype).set_(mapped, 0, shape, _contiguous_strides(shape))
            else:
                out[name] = torch.empty(shape, dtype=dtype)
            self._close(name)
        return out

    def _close(self, name: str) -> None:
        fd, path = self._files.pop(name)[:2]
        os.close(fd)
        if path is not None:
            os.unlink(path)

    def close(self) -> None:
        """Close (and remove) every file not finished; idempotent."""
        for name in list(self._files):
            self._close(name)

    def __enter__(self) -> RowFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))
