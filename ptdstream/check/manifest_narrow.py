"""Finer digests for integrity manifests: which sections, keys and 4 KiB blocks differ.

A manifest's piece digests (8 MiB) say a piece is bad; :class:`RangeDigester` adds, in
the same single read of the file, the xxh3-128 digest of every section and key range
and a 4-byte check (low 32 bits of xxh3-64) of every ``BLOCK_NBYTES`` block. Verifying
digests the file against the ranges the MANIFEST recorded (not the ones the file now
parses to, which a cut or corrupt file may not have), so an intact key of a truncated
file is not reported, and a flipped byte is placed in its section and block.

Memory: 4 bytes per block (4 MiB for a 4 GiB file) and one hasher per range that the
current piece overlaps.
"""

from __future__ import annotations

import bisect
from array import array
from typing import Dict, List, Optional, Sequence, Tuple

import xxhash

BLOCK_NBYTES = 4096


def block_check(data) -> int:
    """The 4-byte check of one block: the low 32 bits of its xxh3-64."""
    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


class RangeDigester:
    """Digests of byte ranges and blocks of a file fed in order, piece by piece.

    ``ranges`` are ``(start, end)`` byte offsets (duplicates allowed, they share a
    hasher); ``block_nbytes`` 0 records no blocks.
    """

    def __init__(self, ranges: Sequence[Tuple[int, int]], block_nbytes: int = BLOCK_NBYTES) -> None:
        self.unique = sorted(set((s, e) for s, e in ranges if e > s))
        self.starts = [s for s, _ in self.unique]
        self.sorted_ends = all(a[1] <= b[0] for a, b in zip(self.unique, self.unique[1:]))
        self.hashers: Dict[Tuple[int, int], "xxhash.xxh3_128"] = {}
        self.seen: Dict[Tuple[int, int], int] = {}
        self.block_nbytes = block_nbytes
        self.blocks = array("I")
        self.pending = bytearray()
        self.offset = 0

    def _overlapping(self, lo: int, hi: int):
        if not self.sorted_ends:
            return [r for r in self.unique if r[0] < hi and r[1] > lo]
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        out = []
        while i < len(self.unique) and self.unique[i][0] < hi:
            if self.unique[i][1] > lo:
                out.append(self.unique[i])
            i += 1
        return out

    def update(self, piece) -> None:
        """Feed the next ``len(piece)`` bytes of the file."""
        lo, n = self.offset, len(piece)
        for r in self._overlapping(lo, lo + n):
            a, b = max(r[0], lo), min(r[1], lo + n)
            self.hashers.setdefault(r, xxhash.xxh3_128()).update(piece[a - lo : b - lo])
            self.seen[r] = self.seen.get(r, 0) + b - a
        if self.block_nbytes:
            view, size = memoryview(piece), self.block_nbytes
            start = 0
            if self.pending:
                start = min(size - len(self.pending), n)
                self.pending += view[:start]
                if len(self.pending) == size:
                    self.blocks.append(block_check(self.pending))
                    self.pending = bytearray()
            whole = start + (n - start) // size * size
            for s in range(start, whole, size):
                self.blocks.append(block_check(view[s : s + size]))
            self.pending += view[whole:]
        self.offset += n

    def finish(self) -> "RangeDigester":
        """Close the last (shorter) block; call once after the last piece."""
        if self.pending:
            self.blocks.append(block_check(self.pending))
            self.pending = bytearray()
        return self

    def digest(self, start: int, end: int) -> Optional[bytes]:
        """xxh3-128 of ``[start, end)``, None when the file did not hold all of it."""
        if end <= start:
            return xxhash.xxh3_128(b"").digest()
        r = (start, end)
        if self.seen.get(r, 0) != end - start:
            return None
        return self.hashers[r].digest()


def key_ranges(sections, keys) -> Dict[str, Tuple[int, int]]:
    """Byte range of each manifest key: the section naming it, or the section of a key
    with the same fingerprint (a key stored once under several names)."""
    by_key = {s.key: (s.offset, s.offset + s.nbytes) for s in sections if s.key is not None}
    prints = {(n, d): by_key[k] for k, n, d in keys if k in by_key}
    out = {}
    for k, n, d in keys:
        r = by_key.get(k) or prints.get((n, d))
        if r is not None:
            out[k] = r
    return out


def first_bad_block(want: Sequence[int], got: Sequence[int]) -> Optional[int]:
    """Index of the first block whose check differs (or is missing), None if all agree."""
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            return i
    return None if len(want) == len(got) else min(len(want), len(got))


def section_at(sections, offset: int):
    """The manifest section holding ``offset``, or None."""
    for s in sections:
        if s.offset <= offset < s.offset + s.nbytes:
            return s
    return None


def differing_sections(sections, digester: RangeDigester) -> List:
    """Sections whose recorded digest differs from the file's (or that the file cuts)."""
    return [s for s in sections if s.digest is not None and digester.digest(s.offset, s.offset + s.nbytes) != s.digest]
