"""The :class:`Source` protocol: where segment payload comes from, read in fixed-size pieces.

A :class:`Source` knows its size in bytes without reading anything, gives its
first bytes cheaply (the dedup candidate filter) and yields its payload as
consecutive ``memoryview`` pieces of at most ``chunk_nbytes``. In-memory sources
(bytes, CPU tensors) yield zero-copy slices of their own memory; file sources
read into a :class:`BufferRing` allocated once per save, so no buffer is
allocated per piece.

What a source must prove when it is written is data, an :class:`Expectation`
(frozen, like the ``WriteItem`` of torch's ``distributed/checkpoint/planner.py``),
given to its constructor or taken by the source itself as it is handed over
(:meth:`Source.hand_over`); no other module sets it afterwards. The size, first
bytes and digest the plan counted on travel in the plan's ``Extent``.

New kinds of source subclass :class:`Source` (see docs/ARCHITECTURE.md); an
object that is not a source but stands for one (executorch interop types)
exposes it with a ``__ptdstream_source__()`` method, which
:func:`ptdstream.sources.as_source` calls.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import NamedTuple

import xxhash

from ..defaults import CHUNK_NBYTES
from ..errors import LayoutError
from .digest import ALGO, Fingerprint, StreamingDigest

__all__ = ["NO_EXPECTATION", "BufferRing", "Expectation", "FileIdentity", "Source", "digest_view"]


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
        self._buffers: list[bytearray] = []
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


class FileIdentity(NamedTuple):
    """A file as ``stat`` saw it: device, inode, size in bytes, modification and
    change time in ns. Equal identities: the same file, not written to between."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        """The identity of a ``stat``/``fstat`` result."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class Expectation:
    """What a source's bytes must still prove when they are written.

    Attributes:
        fingerprint: the xxh3-128 :class:`~ptdstream.sources.digest.Fingerprint`
            the bytes had when they were handed over (or where they were digested
            before: executorch's emitter hashing a constant, a spill file, a
            checkpoint's first load). The store and the writer
            (:func:`~ptdstream.sources.fingerprint.check_expected`) raise
            ``IntegrityError`` and publish nothing when the bytes as read differ.
            ``None``: nothing recorded.
        gpu_fingerprint: the bytes' GPU fingerprint
            (:func:`~ptdstream.sources.cuda_fingerprint.gpu_fingerprint`) when they
            were handed over; a CUDA source recomputes it once every byte is copied
            out and raises ``IntegrityError`` when it differs. A source whose bytes
            were copied off the GPU keeps the fingerprint of where they came from
            here (for callers that matched them by it); its bytes are checked
            against ``fingerprint``. ``None``: nothing recorded.
        file: the :class:`FileIdentity` of the file the bytes are read from, as
            it was when it was handed over (a checkpoint: when it was opened); a
            file source checks it before and after each read and raises
            ``IntegrityError`` when it differs (the file was replaced or written
            to). ``None``: the source takes it itself when it is created.
    """

    fingerprint: Fingerprint | None = None
    gpu_fingerprint: Fingerprint | None = None
    file: FileIdentity | None = None


def digest_view(view: memoryview) -> Fingerprint:
    """xxh3-128 of a 1-D byte view, in one call (an in-memory source's hand-over digest)."""
    return Fingerprint(len(view), ALGO, xxhash.xxh3_128(view).digest())


#: Nothing to prove beyond the plan's size, first bytes and digest.
NO_EXPECTATION = Expectation()


class Source(ABC):
    """Payload of one buffer: a known size, a cheap prefix, pieces on demand.

    Subclasses are cheap to construct: nothing is read or copied until
    :meth:`pieces` is iterated (or :meth:`hand_over` digests a mutable source).
    A subclass that is given an :class:`Expectation` stores it as
    ``self._expectation`` in its constructor.
    """

    #: Size in bytes, fixed when the source is created.
    nbytes: int

    _expectation: Expectation = NO_EXPECTATION

    @property
    def expectation(self) -> Expectation:
        """What the bytes must still prove when they are written (frozen)."""
        return self._expectation

    @property
    def is_mutable(self) -> bool:
        """Whether the caller may change the bytes between hand-over and write with
        nothing but a digest taken at hand-over to notice (memory it can write to).

        ``True`` unless a subclass says otherwise, so that a new kind of source is
        digested at hand-over (:meth:`hand_over`) without anyone knowing its
        class. ``False`` for bytes that cannot change (``bytes``) and for sources
        that check themselves when read (a file's identity and change time).
        """
        return True

    def hand_over(self, fingerprint: Fingerprint | None = None) -> Source:
        """Record what the bytes must prove at write time, as they are handed over; returns ``self``.

        Called by the store for each source added and by the manager's save for
        each buffer. A source whose expectation has a ``fingerprint`` already is
        returned as it is (the first digest is the one its bytes must match).
        Otherwise ``fingerprint`` (a digest the caller took of these bytes just
        now, in the same pass as its own: the emitter's SHA-256) is recorded, or,
        when none is given and the source :attr:`is_mutable`, its bytes are
        digested now (xxh3-128, one pass over them; no buffer allocated for
        in-memory sources).

        Raises:
            IntegrityError: the bytes can no longer be read (a tensor whose
                storage was freed); other errors of :meth:`pieces` pass through.
        """
        if self.expectation.fingerprint is not None:
            return self
        if fingerprint is None:
            if not self.is_mutable:
                return self
            fingerprint = self._digest_at_hand_over()
        self._expectation = replace(self.expectation, fingerprint=fingerprint)
        return self

    def _digest_at_hand_over(self) -> Fingerprint:
        """The bytes' xxh3-128 as they are now (for :meth:`hand_over`): one pass
        through :meth:`pieces`; in-memory sources digest their view at once."""
        digest = StreamingDigest()
        for piece in self.pieces(BufferRing(count=1)):
            digest.update(piece)
        return digest.finish()

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

    def same_content(self, other: Source) -> bool | None:
        """Decide equality with ``other`` without the host digest, when this kind of
        source can (CUDA sources compare on the device); ``None`` if it cannot."""
        return None

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.nbytes} bytes: {self.describe()}>"
