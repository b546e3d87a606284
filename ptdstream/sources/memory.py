"""In-memory sources: bytes, bytearray and any C-contiguous buffer, read in place."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import IntegrityError, LayoutError
from .base import BufferRing, Source, digest_view
from .digest import Fingerprint

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

__all__ = ["MemorySource"]


class MemorySource(Source):
    """Bytes, bytearray or any C-contiguous buffer, read in place (no copy).

    A mutable buffer (anything but ``bytes``) changed between hand-over and
    write is caught by the fingerprint taken at hand-over
    (:meth:`~ptdstream.sources.base.Source.hand_over`).
    """

    def __init__(self, data: ReadableBuffer, label: str = "bytes") -> None:
        view = memoryview(data)
        if not view.c_contiguous:
            raise LayoutError(f"{label}: buffer is not C-contiguous")
        self._view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self.nbytes = self._view.nbytes
        self._label = label

    def describe(self) -> str:
        return self._label

    @property
    def base(self) -> ReadableBuffer:
        """The object the bytes are read from (``bytes`` is immutable)."""
        return self._view.obj

    def view(self) -> memoryview:
        """The bytes, in place."""
        return self._view

    @property
    def is_mutable(self) -> bool:
        """``False`` for ``bytes`` (and views of them), ``True`` for any other buffer."""
        return not isinstance(self.base, bytes)

    def _digest_at_hand_over(self) -> Fingerprint:
        return digest_view(self._view)

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
