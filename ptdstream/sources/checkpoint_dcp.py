"""The ``torch.distributed.checkpoint`` (DCP) kind: the metadata read with
``FileSystemReader`` (a pickle: opened only when named), each tensor loaded with
``torch.distributed.checkpoint.load`` when read, one at a time.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ..errors import FormatError, IntegrityError
from .base import BufferRing, Expectation, Source
from .checkpoint_base import Checkpoint, CheckpointEntry
from .fingerprint import Fingerprint, StreamingDigest
from .tensor import TensorSource

if TYPE_CHECKING:
    import torch

__all__ = ["DcpCheckpoint", "DcpTensorSource"]


class DcpTensorSource(Source):
    """One tensor of a DCP checkpoint, loaded with DCP's reader when read.

    :meth:`prefix` loads it once to take its first bytes and its xxh3-128 digest
    (kept as ``expected_fingerprint``: the write checks the second load against
    it); :meth:`pieces` loads it again and frees it after the last piece.
    """

    #: A checkpoint on disk: the second load is checked against the first.
    is_mutable = False

    def __init__(self, folder: str, entry: CheckpointEntry,
                 load: Callable[[str, CheckpointEntry], torch.Tensor]) -> None:
        self.folder = folder
        self.entry = entry
        self.nbytes = entry.nbytes
        self._load = load
        self._prefix: bytes | None = None
        self.expected_fingerprint: Fingerprint | None = None

    @property
    def expectation(self) -> Expectation:
        """The first load's digest (once :meth:`prefix` has run): the write checks the second load."""
        return Expectation(fingerprint=self.expected_fingerprint)

    def describe(self) -> str:
        return f"{self.folder}: key {self.entry.key!r}"

    def _tensor_source(self) -> TensorSource:
        return TensorSource(self._load(self.entry.key, self.entry), self.describe())

    def prefix(self, nbytes: int = 32) -> bytes:
        if self._prefix is None:
            source = self._tensor_source()
            digest = StreamingDigest()
            for piece in source.pieces(BufferRing(count=1)):
                digest.update(piece)
            self._prefix = source.prefix(32)
            self.expected_fingerprint = digest.finish()
        return self._prefix[:nbytes]

    def same_content(self, other: Source) -> bool | None:
        if isinstance(other, DcpTensorSource) and other.nbytes == self.nbytes:
            self.prefix()
            other.prefix()
            return self.expected_fingerprint == other.expected_fingerprint
        return None

    def pieces(self, ring: BufferRing) -> Iterator[memoryview]:
        # Copied into the ring: a piece may still be being written (by the writer
        # thread) after this generator ends and the loaded tensor is freed.
        source = self._tensor_source()
        for piece in source.pieces(ring):
            buf = ring.next()[: len(piece)]
            buf[:] = piece
            yield buf


class DcpCheckpoint(Checkpoint):
    """A ``torch.distributed.checkpoint`` directory (``FileSystemReader``).

    Only tensor entries are listed; other entries (bytes, Python objects) are in
    ``skipped``.

    Raises:
        FormatError: DCP cannot read the metadata.
    """

    kind = "dcp"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        _refuse_special_files(path)
        try:
            metadata = FileSystemReader(path).read_metadata()
        except Exception as e:  # noqa: BLE001 - any failure of DCP's reader is reported as FormatError
            raise FormatError(f"{path}: DCP could not read its metadata: {type(e).__name__}: {e}") from None
        self.skipped: list[str] = []
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                self.skipped.append(key)
                continue
            shape = tuple(int(s) for s in md.size)
            numel = 1
            for s in shape:
                numel *= s
            itemsize = _itemsize(md.properties.dtype)
            self.entries[key] = CheckpointEntry(
                key, md.properties.dtype, shape, tuple(range(len(shape))), numel * itemsize, path
            )

    def _load_one(self, key: str, entry: CheckpointEntry) -> torch.Tensor:
        import torch
        import torch.distributed.checkpoint as dcp

        tensor = torch.empty(entry.shape, dtype=entry.dtype)
        try:
            dcp.load({key: tensor}, storage_reader=dcp.FileSystemReader(self.path), no_dist=True)
        except Exception as e:  # noqa: BLE001 - any failure of DCP's load is reported as IntegrityError
            raise IntegrityError(f"{self.path}: key {key!r}: DCP could not load it: {type(e).__name__}: {e}") from None
        return tensor

    def _source(self, key: str) -> Source:
        return DcpTensorSource(self.path, self.entries[key], self._load_one)


def _refuse_special_files(folder: str) -> None:
    """Refuse a FIFO, socket or device directly in the DCP folder (symlinks
    followed): DCP's reader opens its files by name, blocking.

    Raises:
        OSError: (``EINVAL``) naming the file and its kind.
    """
    from ..system.files import not_regular

    with os.scandir(folder) as entries:
        for entry in entries:
            try:
                mode = os.stat(entry.path).st_mode
            except FileNotFoundError:  # a dangling link: DCP names it if it needs it
                continue
            refused = None if stat.S_ISDIR(mode) else not_regular(mode, entry.path)
            if refused is not None:
                raise refused


def _itemsize(dtype: torch.dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()
