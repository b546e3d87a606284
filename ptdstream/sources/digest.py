"""Content identity of a buffer: :class:`Fingerprint` and the streamed xxh3-128
:class:`StreamingDigest` (no other ptdstream import: :mod:`.base` and
:mod:`.fingerprint` both build on it)."""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

__all__ = ["ALGO", "Fingerprint", "StreamingDigest"]

#: The host digest's algorithm name, as recorded in a :class:`Fingerprint`.
ALGO = "xxh3-128"


@dataclass(frozen=True)
class Fingerprint:
    """Content identity of a buffer: size in bytes, algorithm name, digest bytes."""

    nbytes: int
    algo: str
    digest: bytes

    @property
    def hex(self) -> str:
        """The digest as hex."""
        return self.digest.hex()

    def __str__(self) -> str:
        return f"{self.algo}:{self.hex}:{self.nbytes}"


class StreamingDigest:
    """xxh3-128 over pieces fed in order; counts the bytes it saw."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_128()
        self.nbytes = 0

    def update(self, piece: bytes | bytearray | memoryview) -> None:
        """Add the next piece of the content."""
        self._hash.update(piece)
        self.nbytes += len(piece)

    def finish(self) -> Fingerprint:
        """The :class:`Fingerprint` of every piece added."""
        return Fingerprint(self.nbytes, ALGO, self._hash.digest())
