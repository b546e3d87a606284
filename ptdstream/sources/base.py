"""The :class:`Source` protocol: where segment payload comes from, read in fixed-size pieces.

A :class:`Source` knows its size in bytes without reading anything, gives its
first bytes cheaply (the dedup candidate filter) and yields its payload as
consecutive ``memoryview`` pieces of at most ``chunk_nbytes``. In-memory sources
(bytes, CPU tensors) yield zero-copy slices of their own memory; file sources
read into a :class:`BufferRing` allocated once per save, so no buffer is
allocated per piece.

New kinds of source subclass :class:`Source` (see docs/ARCHITECTURE.md); an
object that is not a source but stands for one (executorch interop types)
exposes it with a ``__ptdstream_source__()`` method, which
:func:`ptdstream.sources.as_source` calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator, List, Optional

from ..defaults import CHUNK_NBYTES
from ..errors import LayoutError

__all__ = ["BufferRing", "Source"]


class BufferRing:
    """``count`` reusable host buffers of ``chunk_nbytes`` bytes each.

    Buffers are allocated lazily on first use and then reused round-robin; a
    piece handed out by :meth:`next` stays valid until ``count`` further calls.
    Not thread-safe.
    """

    def __init__(self, chunk_nbytes: int = CHUNK_NBYTES, count: int = 2) -> None:
        if chunk_nbytes <= 0 or count <= 0:
            raise LayoutError(
                f"chunk_nbytes and count must be > 0, got {chunk_nbytes} and {count}"
            )
        self.chunk_nbytes = chunk_nbytes
        self.count = count
        self._buffers: List[bytearray] = []
        self._next = 0

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

    #: Where the bytes live: ``"cpu"`` (host memory or a file) or ``"cuda"``.
    device_kind = "cpu"

    #: A :class:`~ptdstream.sources.fingerprint.Fingerprint` the bytes must still have
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
