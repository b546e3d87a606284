"""Fingerprints: the dedup candidate filter and a streamed xxh3-128 digest.

Dedup follows upstream's two levels (``exir/_serialize/_named_data_store.py``):
a cheap candidate key, ``(nbytes, first 32 bytes)``, rejects almost every
non-duplicate without reading the payload; only buffers whose candidate keys
collide are digested. Upstream confirms with SHA-256; ptdstream uses xxh3-128,
about 10x faster per core. For a fixed pair of distinct inputs the probability
that their xxh3-128 digests collide is about 2^-128, so the equality classes
are upstream's except with that probability.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import xxhash

from ..errors import IntegrityError
from .base import BufferRing, Source

#: Bytes of the prefix in the candidate key (upstream uses 32).
PREFIX_NBYTES = 32
ALGO = "xxh3-128"

CandidateKey = Tuple[int, bytes]


@dataclass(frozen=True)
class Fingerprint:
    """Content identity of a buffer: size in bytes, algorithm name, digest bytes."""

    nbytes: int
    algo: str
    digest: bytes

    @property
    def hex(self) -> str:
        return self.digest.hex()

    def __str__(self) -> str:
        return f"{self.algo}:{self.hex}:{self.nbytes}"


def candidate_key(source: Source) -> CandidateKey:
    """``(nbytes, first 32 bytes)``: equal for every pair of equal buffers."""
    return (source.nbytes, source.prefix(PREFIX_NBYTES))


class StreamingDigest:
    """xxh3-128 over pieces fed in order; counts the bytes it saw."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_128()
        self.nbytes = 0

    def update(self, piece) -> None:
        self._hash.update(piece)
        self.nbytes += len(piece)

    def finish(self) -> Fingerprint:
        return Fingerprint(self.nbytes, ALGO, self._hash.digest())


def fingerprint(source: Source, ring: BufferRing) -> Fingerprint:
    """Read ``source`` once, in pieces through ``ring``, and digest it."""
    digest = StreamingDigest()
    for piece in source.pieces(ring):
        digest.update(piece)
    return digest.finish()


def check_expected(source: Source, fp: Fingerprint, where: str = "") -> None:
    """Refuse a source whose bytes changed since they were first digested.

    ``source.expected_fingerprint`` is set where the data was digested before it
    was handed over (executorch's emitter hashing a constant); ``fp`` is the
    digest taken now. ``where`` prefixes the message (file, key, offset).

    Raises:
        IntegrityError: the two differ.
    """
    expected = source.expected_fingerprint
    if expected is not None and fp != expected:
        raise IntegrityError(
            f"{where}{source.describe()} changed after it was handed over "
            f"(digest {fp.hex} != {expected.hex} when emitted); nothing was published"
        )
