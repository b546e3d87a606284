"""Fingerprints: the dedup candidate filter and a streamed xxh3-128 digest.

Dedup follows upstream's two levels (``exir/_serialize/_named_data_store.py``):
a cheap candidate key, ``(nbytes, first 32 bytes)``, rejects almost every
non-duplicate without reading the payload; only buffers whose candidate keys
collide are digested. Upstream confirms with SHA-256; ptdstream uses xxh3-128,
which costs far less CPU per byte. For a fixed pair of distinct inputs the probability
that their xxh3-128 digests collide is about 2^-128, so the equality classes
are upstream's except with that probability.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import xxhash

from ..errors import IntegrityError
from .base import BufferRing, Source

__all__ = [
    "PREFIX_NBYTES",
    "CandidateKey",
    "Fingerprint",
    "StreamingDigest",
    "candidate_key",
    "check_expected",
    "fingerprint",
    "seal",
]

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


def seal(source: Source) -> Source:
    """Fingerprint a mutable memory source as it is handed over; returns it.

    A ``bytearray``, a ``memoryview`` of a mutable buffer or a CPU tensor may be
    written to by the caller while the save runs; upstream copies it at hand-over,
    ptdstream reads it in place. Its xxh3-128 digest is taken now (one pass over
    its bytes, on the calling thread) into ``source.expected_fingerprint``, and the
    writer, which digests each piece after writing it, refuses the source when
    the two differ (:func:`check_expected`): nothing torn is published.
    ``bytes`` (immutable), file sources (checked by identity and change time),
    CUDA sources, and sources already fingerprinted are returned as they are.

    Raises:
        IntegrityError: a tensor whose storage was already freed.
    """
    from .memory import MemorySource
    from .tensor import TensorSource

    if source.expected_fingerprint is not None:
        return source
    if isinstance(source, MemorySource):
        if isinstance(source.base, bytes):
            return source
    elif type(source) is not TensorSource:
        return source
    view = source.view()
    source.expected_fingerprint = Fingerprint(len(view), ALGO, xxhash.xxh3_128(view).digest())
    return source


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
            f"(digest {fp.hex} as written != {expected.hex} when handed over); "
            "nothing was published"
        )
