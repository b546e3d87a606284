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

from ..errors import IntegrityError
from .base import BufferRing, Source
from .digest import ALGO, Fingerprint, StreamingDigest

__all__ = ["ALGO", "PREFIX_NBYTES", "CandidateKey", "Fingerprint", "StreamingDigest", "candidate_key",
           "check_expected", "fingerprint"]

#: Bytes of the prefix in the candidate key (upstream uses 32).
PREFIX_NBYTES = 32

CandidateKey = tuple[int, bytes]


def candidate_key(source: Source) -> CandidateKey:
    """``(nbytes, first 32 bytes)``: equal for every pair of equal buffers."""
    return (source.nbytes, source.prefix(PREFIX_NBYTES))


def fingerprint(source: Source, ring: BufferRing) -> Fingerprint:
    """Read ``source`` once, in pieces through ``ring``, and digest it."""
    digest = StreamingDigest()
    for piece in source.pieces(ring):
        digest.update(piece)
    return digest.finish()


def check_expected(source: Source, fp: Fingerprint, where: str = "") -> None:
    """Refuse a source whose bytes changed since they were first digested.

    ``source.expectation.fingerprint`` is the digest the bytes had when they were
    handed over (:meth:`~ptdstream.sources.base.Source.hand_over`; or where they
    were digested before: executorch's emitter hashing a constant, a spill, a
    checkpoint's first load); ``fp`` is the digest taken now. ``where`` prefixes
    the message (file, key, offset).

    Raises:
        IntegrityError: the two differ.
    """
    expected = source.expectation.fingerprint
    if expected is not None and fp != expected:
        raise IntegrityError(
            f"{where}{source.describe()} changed after it was handed over "
            f"(digest {fp.hex} as written != {expected.hex} when handed over); "
            "nothing was published"
        )
