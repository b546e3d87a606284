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

On a tmpfs the copied bytes stay in memory: give a folder on disk.
"""

from __future__ import annotations

import ctypes
import errno
import os
import tempfile
from typing import Any

from ..system.files import pwrite_all

__all__ = ["mapped_copy"]


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
        try:
            pwrite_all(fd, memoryview((ctypes.c_char * nbytes).from_address(storage.data_ptr())).cast("B"), 0)
        except OSError as e:
            raise OSError(e.errno, f"temp folder {folder}: cannot write {nbytes:,} bytes there: "
                                   f"{e.strerror}") from e
        mapped: torch.UntypedStorage = torch.UntypedStorage.from_file(  # type: ignore[assignment]  # an UntypedStorage's from_file returns one
            name or f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes)
    finally:
        os.close(fd)
        if name is not None:
            os.unlink(name)
    return torch.empty(0, dtype=tensor.dtype).set_(mapped, tensor.storage_offset(), tensor.shape, tensor.stride())
