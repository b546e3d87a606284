"""The seekable zstd format: the seek table, ptdstream's content frame, zstd frame extents.

Byte layout (zstd ``contrib/seekable_format/zstd_seekable_compression_format.md``,
little-endian): independent zstd frames, then the seek table, a skippable frame
that ends the file: u32 0x184D2A5E, u32 size of the rest; per frame u32 compressed
size, u32 decompressed size, [u32 checksum]; u32 frame count, u8 descriptor (bit 7:
checksums present; bits 6-2 reserved, must be 0), u32 0x8F92EAB1. A checksum is the
low 32 bits of XXH64 (seed 0) of the frame's decompressed bytes, the value zstd
itself stores at a frame's end. Skippable frames among the frames are listed with
decompressed size 0; ptdstream lists one last, the :class:`ContentFrame` (content
size and xxh3-128), so unpack checks the whole result, not only each frame.

The seek table is checked against the file size before anything is allocated from
it (:func:`read_seek_table`); :func:`zstd_frame_extent` finds a frame's extent by
walking its block headers. Structure that disagrees raises
:class:`~ptdstream.errors.FormatError` naming the file, the frame index and offset.
"""

from __future__ import annotations

import bisect
import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from ..errors import FormatError
from ..format.identity import SKIPPABLE_MAGIC_BASE, ZSTD_MAGIC, is_zstd, kind_of

__all__ = [
    "EMPTY_CHECKSUM",
    "SEEKABLE_MAGIC",
    "SEEK_TABLE_MAGIC",
    "MAX_FRAMES",
    "MAX_FRAME_NBYTES",
    "SKIPPABLE_HEADER_NBYTES",
    "SKIPPABLE_MAGIC_BASE",
    "ContentFrame",
    "FrameEntry",
    "encode_seek_table",
    "frame_checksum",
    "not_zstd_message",
    "read_seek_table",
    "walk_zstd_frame",
    "zstd_frame_extent",
]

SEEK_TABLE_MAGIC = 0x184D2A5E
SEEKABLE_MAGIC = 0x8F92EAB1
SKIPPABLE_HEADER_NBYTES = 8
FOOTER_NBYTES = 9
CHECKSUM_FLAG = 0x80
RESERVED_BITS = 0x7C
#: Upstream's limits (``zstd_seekable.h``): frames per file, bytes per frame.
MAX_FRAMES = 0x8000000
MAX_FRAME_NBYTES = 0x40000000
#: ``xxh64(b"") & 0xFFFFFFFF``: the checksum of an empty (skippable) frame.
EMPTY_CHECKSUM = xxhash.xxh64_intdigest(b"") & 0xFFFFFFFF
_ENTRY = struct.Struct("<II")
_ENTRY_CHECKSUM = struct.Struct("<III")
_FOOTER = struct.Struct("<IBI")
_HEADER = struct.Struct("<II")


def frame_checksum(data) -> int:
    """The seek-table checksum of a frame's decompressed bytes (u32)."""
    return xxhash.xxh64_intdigest(data) & 0xFFFFFFFF


@dataclass(frozen=True)
class FrameEntry:
    """One frame. ``compressed_offset``/``compressed_nbytes``: its bytes in the
    packed file; ``offset``/``nbytes``: its bytes in the decompressed content;
    ``checksum``: the seek table's u32, None when the table has none."""

    index: int
    compressed_offset: int
    compressed_nbytes: int
    offset: int
    nbytes: int
    checksum: int | None

    @property
    def end(self) -> int:
        """The content offset just past the frame's content."""
        return self.offset + self.nbytes

    def where(self, name: str) -> str:
        """The frame named in messages: index, compressed offset and size, content range."""
        return (f"{name}: frame {self.index} at offset {self.compressed_offset} "
                f"({self.compressed_nbytes} bytes, content [{self.offset}, {self.end}))")


@dataclass(frozen=True)
class SeekTable:
    """A parsed seek table. ``table_offset``: where the seek table frame starts
    (the frames fill ``[0, table_offset)``); ``nbytes``: decompressed bytes in all."""

    frames: tuple[FrameEntry, ...]
    checksums: bool
    table_offset: int
    file_nbytes: int

    @property
    def nbytes(self) -> int:
        """The content's length in bytes (the end of the last frame)."""
        return self.frames[-1].end if self.frames else 0

    @functools.cached_property
    def _starts(self) -> list[int]:
        return [f.offset for f in self.frames]

    def covering(self, offset: int, nbytes: int) -> list[FrameEntry]:
        """The frames holding content bytes ``[offset, offset + nbytes)`` (none if empty)."""
        if nbytes <= 0:
            return []
        starts = self._starts
        first = bisect.bisect_right(starts, offset) - 1
        last = bisect.bisect_right(starts, offset + nbytes - 1) - 1
        return [f for f in self.frames[first : last + 1] if f.nbytes]


def encode_seek_table(entries: Sequence[tuple[int, int, int]], checksums: bool) -> bytes:
    """The seek table frame for ``(compressed_nbytes, nbytes, checksum)`` entries.

    Raises:
        ValueError: more than :data:`MAX_FRAMES` entries or a size over u32.
    """
    if len(entries) > MAX_FRAMES:
        raise ValueError(f"{len(entries)} frames, more than the seekable format's {MAX_FRAMES}")
    if checksums:
        body = b"".join(_ENTRY_CHECKSUM.pack(c, d, s) for c, d, s in entries)
    else:
        body = b"".join(_ENTRY.pack(c, d) for c, d, _ in entries)
    footer = _FOOTER.pack(len(entries), CHECKSUM_FLAG if checksums else 0, SEEKABLE_MAGIC)
    return _HEADER.pack(SEEK_TABLE_MAGIC, len(body) + len(footer)) + body + footer


def not_zstd_message(name: str, head: bytes) -> str:
    """Why ``name`` (first bytes ``head``) cannot be unpacked: an ExecuTorch file
    itself, or no zstd at all."""
    kind = kind_of(head[4:8]) if len(head) >= 8 else None
    if kind is not None:
        return (f"{name}: a .{kind} itself (identifier {head[4:8].decode('ascii', 'replace')}), not a packed file: "
                "nothing to unpack or extract (ptdstream pack makes a packed file of it)")
    shown = f"0x{int.from_bytes(head[:4], 'little'):08X}" if len(head) >= 4 else f"{len(head)} bytes"
    return (f"{name}: not a zstd file: it starts with {shown}, where a zstd frame starts with 0x{ZSTD_MAGIC:08X}; "
            "nothing to unpack or extract")


def read_seek_table(name: str, file_nbytes: int, read_at, max_frame_nbytes: int = MAX_FRAME_NBYTES) -> SeekTable:
    """Parse and check the seek table at the end of a file of ``file_nbytes`` bytes.

    ``read_at(offset, nbytes) -> bytes`` reads the file. Memory: the table itself
    (12 bytes a frame), allocated only after its size was checked against the file.

    Raises:
        FormatError: no seek table at the end (truncated, or not in the seekable
            format), reserved bits set, or sizes that do not add up to the file.
    """
    least = SKIPPABLE_HEADER_NBYTES + FOOTER_NBYTES
    head = bytes(read_at(0, min(8, file_nbytes)))
    if not is_zstd(head) and (file_nbytes < least or _FOOTER.unpack(read_at(file_nbytes - FOOTER_NBYTES,
                                                                            FOOTER_NBYTES))[2] != SEEKABLE_MAGIC):
        raise FormatError(not_zstd_message(name, head))
    if file_nbytes < least:
        raise FormatError(f"{name}: file is {file_nbytes} bytes, shorter than the smallest seek table "
                          f"({least} bytes): truncated, or not a seekable zstd file")
    footer_offset = file_nbytes - FOOTER_NBYTES
    count, descriptor, magic = _FOOTER.unpack(read_at(footer_offset, FOOTER_NBYTES))
    if magic != SEEKABLE_MAGIC:
        raise FormatError(f"{name}: at offset {footer_offset + 5}: last 4 bytes are 0x{magic:08X}, not the seekable "
                          f"magic 0x{SEEKABLE_MAGIC:08X}: a plain zstd file (no seek table: ptdstream unpack streams "
                          "it; extract needs a file ptdstream pack made), or a packed file cut short")
    if descriptor & RESERVED_BITS:
        raise FormatError(f"{name}: at offset {footer_offset + 4}: seek table descriptor 0x{descriptor:02X} "
                          "sets reserved bits 6-2 (a newer format, or a corrupt file)")
    checksums = bool(descriptor & CHECKSUM_FLAG)
    entry = _ENTRY_CHECKSUM if checksums else _ENTRY
    table_nbytes = SKIPPABLE_HEADER_NBYTES + count * entry.size + FOOTER_NBYTES
    if count > MAX_FRAMES or table_nbytes > file_nbytes:
        raise FormatError(f"{name}: at offset {footer_offset}: seek table claims {count} frames "
                          f"({table_nbytes} table bytes), more than the file's {file_nbytes} bytes hold")
    table_offset = file_nbytes - table_nbytes
    skip_magic, frame_size = _HEADER.unpack(read_at(table_offset, SKIPPABLE_HEADER_NBYTES))
    if skip_magic != SEEK_TABLE_MAGIC or frame_size != table_nbytes - SKIPPABLE_HEADER_NBYTES:
        raise FormatError(f"{name}: at offset {table_offset}: seek table frame header is magic 0x{skip_magic:08X} "
                          f"size {frame_size}; expected 0x{SEEK_TABLE_MAGIC:08X} size "
                          f"{table_nbytes - SKIPPABLE_HEADER_NBYTES} for {count} frames")
    raw = read_at(table_offset + SKIPPABLE_HEADER_NBYTES, count * entry.size)
    frames, c_off, d_off = [], 0, 0
    for i, values in enumerate(entry.iter_unpack(raw)):
        c_nbytes, d_nbytes = values[0], values[1]
        f = FrameEntry(i, c_off, c_nbytes, d_off, d_nbytes, values[2] if checksums else None)
        if d_nbytes > max_frame_nbytes:
            raise FormatError(f"{f.where(name)}: decompressed size {d_nbytes} is over the limit of "
                              f"{max_frame_nbytes} bytes a frame (raise max_frame_nbytes to read it)")
        if c_nbytes < SKIPPABLE_HEADER_NBYTES:
            raise FormatError(f"{f.where(name)}: compressed size {c_nbytes} is below the smallest frame (8 bytes)")
        frames.append(f)
        c_off += c_nbytes
        d_off += d_nbytes
    if c_off != table_offset:
        raise FormatError(f"{name}: at offset {table_offset}: the seek table lists {count} frames of {c_off} "
                          f"compressed bytes in all, but {table_offset} bytes precede the seek table "
                          "(seek table disagrees with the frames, or the file was cut or extended)")
    return SeekTable(tuple(frames), checksums, table_offset, file_nbytes)


@dataclass(frozen=True)
class ContentFrame:
    """ptdstream's skippable frame (magic 0x184D2A5D), listed last in the seek table.

    Body (52 bytes): ``b"PTDZ"``, u16 version (1), u16 flags (0), u64
    content_nbytes, 16 bytes xxh3-128 of the content (big-endian digest), u64
    frame_nbytes (the nominal frame size), u64 head_nbytes (end of the .pte/.ptd
    metadata, a frame boundary; 0 for other files), u32 low 32 bits of XXH64 of
    the 48 bytes before it.
    """

    content_nbytes: int
    content_xxh3_128: bytes
    frame_nbytes: int
    head_nbytes: int

    MAGIC = 0x184D2A5D
    BODY_MAGIC = b"PTDZ"
    VERSION = 1
    _BODY = struct.Struct("<4sHHQ16sQQ")
    FRAME_NBYTES = SKIPPABLE_HEADER_NBYTES + _BODY.size + 4

    def to_frame(self) -> bytes:
        """The whole skippable frame: header, 52-byte body and its checksum."""
        body = self._BODY.pack(self.BODY_MAGIC, self.VERSION, 0, self.content_nbytes,
                               self.content_xxh3_128, self.frame_nbytes, self.head_nbytes)
        body += struct.pack("<I", frame_checksum(body))
        return _HEADER.pack(self.MAGIC, len(body)) + body

    @classmethod
    def from_frame(cls, name: str, entry: FrameEntry, data: bytes) -> ContentFrame | None:
        """The content frame in ``data`` (a whole skippable frame), None if it is not
        one (or of a later version).

        Raises:
            FormatError: a 60-byte frame with the manifest's frame magic or body
                magic whose magics or own checksum do not match.
        """
        if len(data) != cls.FRAME_NBYTES:
            return None
        magic, size = _HEADER.unpack_from(data)
        body = data[SKIPPABLE_HEADER_NBYTES:]
        # Claimed by its frame magic or by its body magic, so one flipped byte in
        # either cannot turn a manifest into a foreign frame that goes unchecked.
        if size != len(body) or (magic != cls.MAGIC and body[:4] != cls.BODY_MAGIC):
            return None
        (check,) = struct.unpack_from("<I", body, cls._BODY.size)
        if magic != cls.MAGIC or body[:4] != cls.BODY_MAGIC or check != frame_checksum(body[: cls._BODY.size]):
            raise FormatError(f"{entry.where(name)}: ptdstream manifest is corrupt "
                              f"(its checksum 0x{check:08X} does not match its fields)")
        _, version, _flags, nbytes, digest, frame_nbytes, head_nbytes = cls._BODY.unpack_from(body)
        if version != cls.VERSION:
            return None
        return cls(nbytes, digest, frame_nbytes, head_nbytes)


def zstd_frame_extent(data) -> tuple[int, int | None, bool]:
    """Walk the zstd frame at the start of ``data``: ``(frame bytes, content size or
    None, has checksum)``. Reads only the frame header and the 3-byte block headers.

    Raises:
        ValueError: the magic, a reserved bit or a block type is invalid, or the
            frame runs beyond ``data`` (the message says which).
    """
    view = memoryview(data)
    return walk_zstd_frame(lambda offset, nbytes: view[offset : offset + nbytes], len(view))


def walk_zstd_frame(read_at, limit: int) -> tuple[int, int | None, bool]:
    """:func:`zstd_frame_extent` of the frame at offset 0 of a source read with
    ``read_at(offset, nbytes)`` (any bytes-like), of which ``limit`` bytes may be
    read: the header, then one 3-byte block header a block (a file is not read
    whole)."""
    if limit < 6 or int.from_bytes(read_at(0, 4), "little") != ZSTD_MAGIC:
        raise ValueError("does not start with the zstd frame magic 0xFD2FB528")
    fhd = read_at(4, 1)[0]
    if fhd & 0x08:
        raise ValueError(f"frame header descriptor 0x{fhd:02X} sets the reserved bit")
    single = fhd >> 5 & 1
    fcs_nbytes = (1 if single else 0, 2, 4, 8)[fhd >> 6]
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    if pos + fcs_nbytes > limit:
        raise ValueError("frame header runs beyond the frame")
    content = None
    if fcs_nbytes:
        content = int.from_bytes(read_at(pos, fcs_nbytes), "little") + (256 if fcs_nbytes == 2 else 0)
    pos += fcs_nbytes
    while True:
        if pos + 3 > limit:
            raise ValueError(f"block header at frame byte {pos} runs beyond the {limit} bytes given")
        header = int.from_bytes(read_at(pos, 3), "little")
        kind = header >> 1 & 3
        if kind == 3:
            raise ValueError(f"block at frame byte {pos} has the reserved block type")
        pos += 3 + (1 if kind == 1 else header >> 3)
        if header & 1:
            break
    has_checksum = bool(fhd & 0x04)
    pos += 4 if has_checksum else 0
    if pos > limit:
        raise ValueError(f"frame needs {pos} bytes, {limit} given")
    return pos, content, has_checksum
