"""The checkpoint object every kind shares: its entries (key, dtype, shape, dim
order, size, file) and a key's bytes as a source, or its tensor as a view of the
file mapping. The kinds are in :mod:`ptdstream.sources.checkpoint_mapped`
(safetensors, ``torch.save``) and :mod:`ptdstream.sources.checkpoint_dcp`;
:func:`ptdstream.sources.checkpoint.open_checkpoint` picks one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import FormatError, MissingKeyError, StateError
from .base import Source
from .concat import ConcatSource

if TYPE_CHECKING:
    import torch

__all__ = ["Checkpoint", "CheckpointEntry"]


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    """One tensor of a checkpoint: its key, torch dtype, shape and dim order (from
    its strides; ``(0, 1, ..., n-1)`` for row-major), its size in bytes, the file
    it is in (``where``) and, where the file says it (safetensors), the file offset
    of its first byte (``offset``, else None)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    dim_order: tuple[int, ...]
    nbytes: int
    where: str
    offset: int | None = None


class Checkpoint:
    """A checkpoint opened for reading: ``entries`` (metadata only, in the
    checkpoint's own order) and :meth:`source` for a key's bytes.

    :meth:`derive` adds a key the checkpoint holds in pieces of its tensors (a
    fused tensor, as transformers builds it on load): ``derived`` maps it to
    its parts; its :meth:`source` reads them in order, it has no mapped view.

    Use as a context manager (or call :meth:`close`): mappings and readers are
    released at exit. ``kind`` is ``"safetensors"``, ``"torch"`` or ``"dcp"``.
    """

    kind = ""

    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: dict[str, CheckpointEntry] = {}
        #: Keys whose tensor is the same memory as another key's -> the first such key.
        self.aliases: dict[str, str] = {}
        #: Keys :meth:`derive` added -> their parts: (checkpoint key, byte offset, byte count), in order.
        self.derived: dict[str, tuple[tuple[str, int, int], ...]] = {}

    def source(self, key: str) -> Source:
        """A :class:`~ptdstream.sources.Source` over the bytes of ``key``, in the
        tensor's memory order (``nbytes`` bytes); a derived key's parts one after another."""
        parts = self.derived.get(key)
        if parts is not None:
            return ConcatSource([self.range_source(k, offset, nbytes) for k, offset, nbytes in parts],
                                f"{self.path}: key {key!r}")
        return self._source(key)

    def _source(self, key: str) -> Source:
        raise NotImplementedError

    def range_source(self, key: str, offset: int, nbytes: int) -> Source:
        """``nbytes`` bytes of ``key``'s tensor (row-major) from byte ``offset``,
        read from the file as :meth:`source` reads a whole key.

        Raises:
            FormatError: a kind whose tensors are loaded, not mapped (DCP), or
                a tensor that is not row-major.
            MissingKeyError, StateError: as :meth:`tensor`.
            ValueError: a range outside the tensor.
        """
        raise FormatError(f"{self.path}: key {key!r}: a {self.kind} checkpoint is loaded, not memory-mapped: "
                          "its tensors cannot be read in ranges")

    def derive(self, key: str, parts: tuple[tuple[str, int, int], ...], dtype: torch.dtype,
               shape: tuple[int, ...], what: str) -> CheckpointEntry:
        """Add ``key``: a row-major ``dtype`` tensor of ``shape`` whose bytes are
        ``parts`` ((checkpoint key, byte offset, byte count), in order), described
        as ``what`` in messages. Returns its entry.

        Raises:
            ValueError: ``key`` is a key of the checkpoint already, a part names
                no key of it or lies outside its tensor, or the parts' bytes are
                not ``shape``'s.
        """
        if key in self.entries:
            raise ValueError(f"{self.path}: key {key!r} is in the checkpoint already: it cannot be derived")
        numel = 1
        for s in shape:
            numel *= s
        itemsize = dtype.itemsize
        for k, offset, nbytes in parts:
            entry = self.entries.get(k)
            if entry is None or k in self.derived or offset < 0 or nbytes < 0 or offset + nbytes > entry.nbytes:
                raise ValueError(f"{self.path}: derived key {key!r}: part ({k!r}, {offset}, {nbytes}) is not a "
                                 "range of a checkpoint tensor")
        total = sum(nbytes for _, _, nbytes in parts)
        if total != numel * itemsize:
            raise ValueError(f"{self.path}: derived key {key!r}: its parts hold {total} bytes, a {dtype} tensor "
                             f"of shape {list(shape)} {numel * itemsize}")
        entry = CheckpointEntry(key, dtype, tuple(shape), tuple(range(len(shape))), total, what)
        self.entries[key] = entry
        self.derived[key] = tuple(parts)
        return entry

    def tensor(self, key: str) -> torch.Tensor:
        """``key``'s tensor as a view of the checkpoint's file mapping (safetensors,
        ``torch.save``): its dtype, shape and strides as in :attr:`entries`, nothing
        read until it is used; one view per key, the same object each call; valid
        while the mapping lives (the view keeps it after :meth:`close`).

        Raises:
            MissingKeyError: the checkpoint has no tensor ``key`` (names the key
                and the checkpoint).
            FormatError: a kind whose tensors are loaded, not mapped (DCP), or
                a derived key: read it with :meth:`source`.
            StateError: called after :meth:`close`.
        """
        if key not in self.entries:
            raise MissingKeyError(f"{self.path}: no tensor {key!r} in this {self.kind} checkpoint "
                                  f"({len(self.entries)} tensors); check the key (or key_map)")
        if key in self.derived:
            raise FormatError(f"{self.path}: key {key!r} is derived from {len(self.derived[key])} pieces of "
                              "the checkpoint's tensors: it has no mapped view; read its bytes with source(key)")
        mapped = self._mapped()
        if mapped is None:
            raise FormatError(f"{self.path}: key {key!r}: a {self.kind} checkpoint is loaded, not "
                              "memory-mapped: it has no mapped view; read its bytes with source(key)")
        if key not in mapped:
            raise StateError(f"{self.path}: key {key!r}: tensor() called after the checkpoint was closed: "
                             "call it while the checkpoint is open")
        return mapped[key]

    def _mapped(self) -> Mapping[str, torch.Tensor] | None:
        """The mapped views by key, or None for a kind that loads its tensors."""
        return None

    def files(self) -> list[str]:
        """The files it reads: ``path`` itself, or every regular file directly in
        it for a folder (a writer refuses to replace any of them)."""
        from ..system.files import files_of

        return files_of(self.path)

    def close(self) -> None:
        """Release mappings and readers."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
