"""Fingerprints that compose across pieces: a tensor split across ranks gets the
same fingerprint as the whole tensor on one rank, however it was split.

The digest is a polynomial hash over the prime field ``p = 2**61 - 1``, evaluated
at ``K = 3`` fixed points ``r_j``::

    H_j(x) = sum_i x[i] * r_j**i  (mod p),   x[i] the i-th byte

A piece holding bytes ``[o, o + m)`` of the whole contributes
``r_j**o * H_j(piece)``, and the contributions of disjoint pieces add up (mod
p) to ``H_j`` of the whole: rank order, piece sizes and the number of pieces do
not matter. Two different byte strings of ``n`` bytes collide in one ``H_j``
for at most ``n - 1`` of the ``p`` points, so with the three points fixed and
inputs not chosen against them, the chance is about ``(n / 2**61) ** 3`` (below
2**-84 for 8 GiB). It is only asked about buffers whose size and first 32 bytes
already match (upstream's candidate key), as in :mod:`ptdstream.sources.fingerprint`.

Speed: the bytes of each 4 KiB row are multiplied by a table of powers as one
float64 matrix product (exact: every sum stays below 2**53), 1 MiB at a time;
meant for dedup candidates (equal size and first 32 bytes), not every tensor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from ..sources.fingerprint import Fingerprint

__all__ = ["combine", "digest_piece"]

P = (1 << 61) - 1
K = 3
ALGO = "poly61x3"
#: Bytes per row of the float64 product: 2**8 * 2**21 * 2**16 = 2**45 < 2**53, so exact.
ROW_NBYTES = 1 << 16
#: Rows multiplied at once (1 MiB of input, 8 MiB of float64).
ROWS = 16
#: Each power is split into 3 limbs of 21 bits (61 bits in all).
_LIMB_BITS = 21
_LIMB_MASK = (1 << _LIMB_BITS) - 1


def _points() -> tuple[int, ...]:
    return tuple(
        int.from_bytes(hashlib.sha256(f"ptdstream poly61 point {j}".encode()).digest()[:8], "little") % (P - 2) + 2
        for j in range(K)
    )


POINTS = _points()
#: ``r_j ** ROW_NBYTES``: the step from one row to the next.
ROW_STEPS = tuple(pow(r, ROW_NBYTES, P) for r in POINTS)
_table = None


def _power_table():
    """float64 ``[ROW_NBYTES, 3K]``: columns ``3j, 3j+1, 3j+2`` hold bits 0-20,
    21-41 and 42-60 of ``r_j**i`` (exact in float64)."""
    global _table
    if _table is None:
        import torch

        columns = []
        for r in POINTS:
            powers, value = [], 1
            for _ in range(ROW_NBYTES):
                powers.append(value)
                value = value * r % P
            full = torch.tensor(powers, dtype=torch.int64)
            columns += [(full >> (_LIMB_BITS * k)) & _LIMB_MASK for k in range(3)]
        _table = torch.stack(columns, dim=1).to(torch.float64)
    return _table


@dataclass(frozen=True)
class PieceDigest:
    """What one piece contributes: the piece's offset and size in the whole
    (bytes) and ``K`` field elements, already shifted to that offset."""

    offset: int
    nbytes: int
    values: tuple[int, ...]


class _Accumulator:
    def __init__(self, offset: int) -> None:
        self.totals = [0] * K
        self.powers = [pow(r, offset, P) for r in POINTS]  # r_j ** (offset of the next row)
        self.carry = bytearray()
        self.nbytes = 0

    def feed(self, buf) -> None:
        data = memoryview(buf).cast("B")
        self.nbytes += len(data)
        if self.carry:
            take = min(len(data), ROW_NBYTES - len(self.carry))
            self.carry += data[:take]
            data = data[take:]
            if len(self.carry) < ROW_NBYTES:
                return
            self._rows(memoryview(self.carry))
            self.carry = bytearray()
        step = ROWS * ROW_NBYTES
        whole = len(data) - len(data) % ROW_NBYTES
        for start in range(0, whole, step):
            self._rows(data[start : min(start + step, whole)])
        if whole < len(data):
            self.carry += data[whole:]

    def finish(self) -> tuple[int, ...]:
        if self.carry:  # zero-padded to a row: the zeros add nothing
            self.carry += bytes(ROW_NBYTES - len(self.carry))
            self._rows(memoryview(self.carry))
            self.carry = bytearray()
        return tuple(self.totals)

    def _rows(self, data) -> None:
        import torch

        x = torch.frombuffer(data, dtype=torch.uint8).to(torch.float64).view(-1, ROW_NBYTES)
        sums = (x @ _power_table()).to(torch.int64).tolist()
        totals, powers = self.totals, self.powers
        for row in sums:
            for j in range(K):
                local = row[3 * j] + (row[3 * j + 1] << _LIMB_BITS) + (row[3 * j + 2] << (2 * _LIMB_BITS))
                totals[j] = (totals[j] + local % P * powers[j]) % P
                powers[j] = powers[j] * ROW_STEPS[j] % P


def digest_piece(pieces: Iterable, offset: int) -> PieceDigest:
    """Digest bytes that sit at ``offset`` in the whole, fed as consecutive
    buffers (memoryviews or bytes) of any sizes.

    Returns the piece's contribution; :func:`combine` adds contributions up.
    """
    import warnings

    acc = _Accumulator(offset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.frombuffer on read-only views: read only here
        for buf in pieces:
            acc.feed(buf)
        values = acc.finish()
    return PieceDigest(offset, acc.nbytes, values)


def combine(nbytes: int, parts: Iterable[PieceDigest]) -> Fingerprint:
    """The fingerprint of a whole of ``nbytes`` bytes from the digests of pieces
    that cover it exactly once (any order).

    Raises:
        ValueError: the pieces overlap, leave a gap or pass the end.
    """
    parts = sorted(parts, key=lambda d: d.offset)
    totals = [0] * K
    end = 0
    for d in parts:
        if d.nbytes == 0:
            continue
        if d.offset != end:
            raise ValueError(f"pieces do not tile the buffer: a piece starts at {d.offset}, expected {end}")
        end += d.nbytes
        totals = [(a + b) % P for a, b in zip(totals, d.values, strict=True)]
    if end != nbytes:
        raise ValueError(f"pieces cover {end} of {nbytes} bytes")
    return Fingerprint(nbytes, ALGO, b"".join(v.to_bytes(8, "little") for v in totals))
