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
from collections.abc import Sequence

import xxhash

from ..errors import FormatError
from ..format.reader import read_artifact
from ..system.files import open_input

__all__ = ["BLOCK_NBYTES", "RangeDigester", "bad_keys_of", "differing_sections", "key_ranges",
           "locate"]

BLOCK_NBYTES = 4096


def block_check(data) -> int:
    """The 4-byte check of one block: the low 32 bits of its xxh3-64."""
    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


class RangeDigester:
    """Digests of byte ranges and blocks of a file fed in order, piece by piece.

    ``ranges`` are ``(start, end)`` byte offsets (duplicates allowed, they share a
    hasher); ``block_nbytes`` 0 records no blocks.
    """

    def __init__(self, ranges: Sequence[tuple[int, int]], block_nbytes: int = BLOCK_NBYTES) -> None:
        self.unique = sorted(set((s, e) for s, e in ranges if e > s))
        self.starts = [s for s, _ in self.unique]
        self.sorted_ends = all(a[1] <= b[0] for a, b in zip(self.unique, self.unique[1:], strict=False))
        self.hashers: dict[tuple[int, int], xxhash.xxh3_128] = {}
        self.seen: dict[tuple[int, int], int] = {}
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

    def finish(self) -> RangeDigester:
        """Close the last (shorter) block; call once after the last piece."""
        if self.pending:
            self.blocks.append(block_check(self.pending))
            self.pending = bytearray()
        return self

    def digest(self, start: int, end: int) -> bytes | None:
        """xxh3-128 of ``[start, end)``, None when the file did not hold all of it."""
        if end <= start:
            return xxhash.xxh3_128(b"").digest()
        r = (start, end)
        if self.seen.get(r, 0) != end - start:
            return None
        return self.hashers[r].digest()


def key_ranges(sections, keys) -> dict[str, tuple[int, int]]:
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


def first_bad_block(want: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first block whose check differs (or is missing), None if all agree."""
    for i, (w, g) in enumerate(zip(want, got, strict=False)):
        if w != g:
            return i
    return None if len(want) == len(got) else min(len(want), len(got))


def section_at(sections, offset: int):
    """The manifest section holding ``offset``, or None."""
    for s in sections:
        if s.offset <= offset < s.offset + s.nbytes:
            return s
    return None


def differing_sections(sections, digester: RangeDigester) -> list:
    """Sections whose recorded digest differs from the file's (or that the file cuts)."""
    return [s for s in sections if s.digest is not None and digester.digest(s.offset, s.offset + s.nbytes) != s.digest]


def bad_keys_of(path: str, entry, ranges: dict[str, tuple[int, int]], digester: RangeDigester) -> tuple[str, ...]:
    """Keys of manifest ``entry`` whose bytes, at the range the manifest gives them, differ
    from their fingerprint. A key whose range the manifest does not record (none in
    practice) is looked up in the file as it parses now."""
    located: dict[str, tuple[int, int]] = {}
    if any(k not in ranges for k, _, _ in entry.keys):
        try:
            art = read_artifact(path)
            located = {e.key: (art.segments[e.segment_index].start, art.segments[e.segment_index].end)
                       for e in art.named}
        except FormatError:
            pass
    bad = []
    for key, nbytes, digest in entry.keys:
        if key in ranges:
            got = digester.digest(*ranges[key])
        elif key in located and located[key][1] - located[key][0] == nbytes:
            with open_input(path) as f:
                f.seek(located[key][0])
                got = xxhash.xxh3_128(f.read(nbytes)).digest()
        else:
            got = None
        if got != digest:
            bad.append(key)
    return tuple(bad)


def locate(entry, bad_piece: int | None, digester: RangeDigester, nbytes: int, bad_sections, bad_keys):
    """(offset, nbytes, section) of the first difference: the first differing block cut to
    the first differing section inside it (version >= 2), else the bad piece (with the
    section of its first differing key, version 1), else where the size changes."""
    offset = span = None
    if entry.block_nbytes:
        i = first_bad_block(entry.blocks, digester.blocks)
        if i is not None:
            offset = i * entry.block_nbytes
            span = max(min(entry.block_nbytes, max(entry.nbytes, nbytes) - offset), 0)
    if offset is None and bad_piece is not None:
        offset = bad_piece * entry.piece_nbytes
        span = max(min(entry.piece_nbytes, max(entry.nbytes, nbytes) - offset), 0)
        if not entry.block_nbytes:
            return offset, span, _v1_section(entry, offset, bad_keys)
    if offset is None and nbytes != entry.nbytes:
        offset, span = min(nbytes, entry.nbytes), abs(nbytes - entry.nbytes)
    if offset is None:
        return None, None, (bad_sections[0] if bad_sections else None)
    inside = [s for s in bad_sections if s.offset < offset + span and s.offset + s.nbytes > offset]
    if inside:
        s = inside[0]
        lo, hi = max(offset, s.offset), min(offset + span, s.offset + s.nbytes)
        return lo, hi - lo, s
    return offset, span, section_at(entry.sections, offset) or (bad_sections[0] if bad_sections else None)


def _v1_section(entry, piece_offset: int, bad_keys):
    """Without finer digests: the first differing key's section inside the bad piece,
    else the section at the piece start."""
    piece_end = piece_offset + entry.piece_nbytes
    for s in entry.sections:
        if s.key is not None and s.offset < piece_end and s.offset + s.nbytes > piece_offset:
            if any(k in bad_keys for k in s.key.split(", ")):
                return s
    return section_at(entry.sections, piece_offset)
