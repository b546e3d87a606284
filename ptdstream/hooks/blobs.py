"""Delegate blobs that stay in their files: a backend hands ``file_blob(path)`` over as its processed bytes.

executorch 1.5.1 keeps each delegate blob (``PreprocessResult.processed_bytes``)
as Python ``bytes`` from ``preprocess`` to the save, so a backend that builds
a 4 GiB engine on disk must load it whole. :func:`file_blob` returns a
:class:`FileBlob` instead: a ``FileBackedData`` over the file that is also
bytes-like (a ``c_char`` array over a private read-only-use ``mmap`` of it,
with content equality and hashing), so upstream's code takes it as it is:

* the emitter (``exir/emit/_emitter.py::_Emitter._emit_delegate``) hashes it
  through the buffer protocol and keeps it as ``BackendDelegateInlineData.data``;
* ``_extract_delegate_segments`` (``exir/_serialize/_program.py``) keys
  segments by it (equal content, one segment) and puts it in a ``Cord``, whose
  ``write_to_file`` reads the file in pieces;
* ``ptdstream.save`` streams it from the file with ``pread`` (pages dropped).

One check refuses it: torch's export verifier
(``torch/_export/verifier.py::Verifier._check_graph_module``) accepts a
``LoweredBackendModule`` only when ``isinstance(processed_bytes, bytes)``.
Inside :func:`delegate_blobs_from_files`, that module's global name ``bytes``
is shadowed by a type whose ``isinstance`` also accepts a :class:`FileBlob`
(its only use of ``bytes``; the module is registered in :mod:`ptdstream.upstream.names`). The
emitter's ``hashlib.sha256(processed_bytes)`` is answered from the blob's
SHA-256 (given to :func:`file_blob`, or read from the file once), so the
mapping is not read at all on the way to the save. The smallest upstream
change that would make this context unnecessary: let that verifier check
accept ``FileBackedData``.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import functools
import mmap
import os
from collections.abc import Iterator
from typing import Any

from ..system.files import open_input
from ..upstream import adapter
from ..upstream.patching import shadowed
from .interop import EMITTER_HASHLIB, ByReference, FileBackedData

__all__ = ["FileBlob", "delegate_blobs_from_files", "file_blob"]


class FileBlob(ByReference, FileBackedData):
    """A delegate blob read from a file, usable where executorch expects ``bytes``.

    Made by :func:`file_blob`. ``len()`` is the file size in bytes; equality and
    ``hash()`` follow the content (SHA-256, read from the file once), as for
    ``bytes``; ``memoryview``/``hashlib`` read the mapping in place; copying and
    pickling as for :class:`~ptdstream.hooks.interop.ByReference`.
    The file must not change until the program is saved.
    """

    def __hash__(self) -> int:
        return hash(self.sha256())

    def __eq__(self, other) -> bool:
        if isinstance(other, FileBlob):
            return len(self) == len(other) and self.sha256() == other.sha256()
        if isinstance(other, (bytes, bytearray, memoryview)):
            return len(self) == len(other) and memoryview(self).cast("B") == memoryview(other).cast("B")
        return NotImplemented

    def __ne__(self, other) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __bool__(self) -> bool:
        return len(self) > 0

    def __repr__(self) -> str:
        return f"<FileBlob {adapter.file_backed_path(self)!r} ({len(self)} bytes)>"


@functools.cache
def _blob_type(nbytes: int) -> type[Any]:
    """:class:`FileBlob` with ``ctypes.c_char * nbytes`` (the buffer protocol over the mapping);
    made at run time, so Any to the checker."""
    return type("FileBlob", (FileBlob, ctypes.c_char * nbytes), {})


def file_blob(path: str | os.PathLike, sha256: bytes | None = None) -> FileBlob | bytes:
    """A delegate blob that stays in ``path``: return it as ``PreprocessResult.processed_bytes``.

    Args:
        path: the blob's file (an engine a backend has just built). It must not
            change or be removed until the program is saved.
        sha256: its SHA-256 digest (32 bytes) when the backend already knows it;
            otherwise it is computed from the file when first needed.

    Returns:
        a :class:`FileBlob` (``b""`` for an empty file: there is nothing to map).

    Raises:
        OSError: the file cannot be opened or mapped (the message names it).
    """
    path = os.fspath(path)
    nbytes = os.path.getsize(path)
    if nbytes == 0:
        return b""
    with open_input(path) as f:
        # ACCESS_COPY: a private mapping (ctypes needs a writable buffer); nothing
        # ever writes to it, so every page stays the file's.
        mapping = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY)
    blob = _blob_type(nbytes).from_buffer(mapping)  # keeps the mapping alive
    adapter.init_file_backed(blob, path, nbytes, sha256)
    return blob


class _BytesOrFileBlobMeta(type):
    def __instancecheck__(cls, value) -> bool:
        return isinstance(value, (builtins.bytes, FileBlob))


class _BytesOrFileBlob(metaclass=_BytesOrFileBlobMeta):
    """What ``bytes`` means to torch's export verifier inside :func:`delegate_blobs_from_files`."""


@contextlib.contextmanager
def delegate_blobs_from_files() -> Iterator[None]:
    """While active, delegate blobs made by :func:`file_blob` pass lowering and emission.

    Wrap both ``to_edge_transform_and_lower`` (or ``to_backend``) and
    ``to_executorch()``: torch's export verifier runs in both. Without it,
    lowering a module whose blob is a :class:`FileBlob` raises torch's
    ``SpecViolationError`` ("processed_bytes(bytes) : <class '...FileBlob'>").
    Nests; the patches are removed when the last context exits. They are
    process-wide while active (the verifier check only widens to accept a
    ``FileBlob``, and only a ``FileBlob`` or a constant reference is hashed
    differently: by its own ``sha256()``).

    Raises:
        ImportError: torch's export verifier or executorch's emitter is not importable.
    """
    with shadowed(adapter.export_verifier_module(), "bytes", _BytesOrFileBlob), \
            shadowed(adapter.emitter_module(), "hashlib", EMITTER_HASHLIB):
        yield
