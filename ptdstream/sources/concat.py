"""A source made of other sources, one after another: a tensor that a checkpoint
holds in several pieces (transformers' fused experts, stacked and concatenated
from one tensor per expert), read piece by piece, never whole in memory."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..errors import IntegrityError
from .base import BufferRing, Source

__all__ = ["ConcatSource"]


class ConcatSource(Source):
    """The bytes of ``parts`` in order (``nbytes``: their sum).

    Each part is read through its own :meth:`~Source.pieces` into the ring; a
    piece never spans two parts, so a piece may be shorter than the ring's
    buffer at a part's end. What each part checks when read (a checkpoint
    file's identity, its size) it checks here too; nothing is digested at
    hand-over (the parts are files, checked when read).

    Raises:
        IntegrityError: while reading, a part that gives another number of bytes
            than it said (names the part and this source's label).
    """

    def __init__(self, parts: Sequence[Source], label: str = "parts") -> None:
        self.parts = tuple(parts)
        self.label = label
        self.nbytes = sum(p.nbytes for p in self.parts)

    #: The parts check themselves when read (a file's identity); not digested at hand-over.
    is_mutable = False

    def describe(self) -> str:
        first = self.parts[0].describe() if self.parts else "nothing"
        return f"{self.label}: {len(self.parts)} part(s) from {first}"

    def prefix(self, nbytes: int = 32) -> bytes:
        out = b""
        for part in self.parts:
            if len(out) >= nbytes:
                break
            out += part.prefix(min(nbytes - len(out), part.nbytes))
        return out[:nbytes]

    def pieces(self, ring: BufferRing) -> Iterator[memoryview]:
        for i, part in enumerate(self.parts):
            got = 0
            for piece in part.pieces(ring):
                got += len(piece)
                if got > part.nbytes:
                    break
                yield piece
            if got != part.nbytes:
                raise IntegrityError(f"{self.label}: part {i} ({part.describe()}) gave {got} bytes, not the "
                                     f"{part.nbytes} it said")
