"""The checkpoint object every kind shares: its entries (key, dtype, shape, dim
order, size, file) and a key's bytes as a source, or its tensor as a view of the
file mapping. The kinds are in :mod:`ptdstream.sources.checkpoint_mapped`
(safetensors, ``torch.save``) and :mod:`ptdstream.sources.checkpoint_dcp`;
:func:`ptdstream.sources.checkpoint.open_checkpoint` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import FormatError, MissingKeyError, StateError
from .base import Source

if TYPE_CHECKING:
    import torch

__all__ = ["Checkpoint", "CheckpointEntry"]


@dataclass(frozen=True)
class CheckpointEntry:
    """One tensor of a checkpoint: its key, torch dtype, shape and dim order (from
    its strides; ``(0, 1, ..., n-1)`` for row-major), and its size in bytes."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    dim_order: tuple[int, ...]
    nbytes: int
    where: str


class Checkpoint:
    """A checkpoint opened for reading: ``entries`` (metadata only, in the
    checkpoint's own order) and :meth:`source` for a key's bytes.

    Use as a context manager (or call :meth:`close`): mappings and readers are
    released at exit. ``kind`` is ``"safetensors"``, ``"torch"`` or ``"dcp"``.
    """

    kind = ""

    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: dict[str, CheckpointEntry] = {}
        #: Keys whose tensor is the same memory as another key's -> the first such key.
        self.aliases: dict[str, str] = {}

    def source(self, key: str) -> Source:
        """A :class:`~ptdstream.sources.Source` over the bytes of ``key``, in the
        tensor's memory order (``nbytes`` bytes)."""
        raise NotImplementedError

    def tensor(self, key: str) -> torch.Tensor:
        """``key``'s tensor as a view of the checkpoint's file mapping (safetensors,
        ``torch.save``): its dtype, shape and strides as in :attr:`entries`, nothing
        read until it is used; one view per key, the same object each call; valid
        while the mapping lives (the view keeps it after :meth:`close`).

        Raises:
            MissingKeyError: the checkpoint has no tensor ``key`` (names the key
                and the checkpoint).
            FormatError: a kind whose tensors are loaded, not mapped (DCP): read
                it with :meth:`source`.
            StateError: called after :meth:`close`.
        """
        if key not in self.entries:
            raise MissingKeyError(f"{self.path}: no tensor {key!r} in this {self.kind} checkpoint "
                                  f"({len(self.entries)} tensors); check the key (or key_map)")
        mapped = self._mapped()
        if mapped is None:
            raise FormatError(f"{self.path}: key {key!r}: a {self.kind} checkpoint is loaded, not "
                              "memory-mapped: it has no mapped view; read its bytes with source(key)")
        if key not in mapped:
            raise StateError(f"{self.path}: key {key!r}: tensor() called after the checkpoint was closed: "
                             "call it while the checkpoint is open")
        return mapped[key]

    def _mapped(self) -> dict[str, torch.Tensor] | None:
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
