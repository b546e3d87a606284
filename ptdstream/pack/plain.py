"""Plain zstd files: what any zstd tool writes, without the seekable format's seek table.

``unpack`` decompresses them as ``zstd -d`` does, streamed from the first frame to
the last (there is no random access, so ``extract`` needs a packed file). Before a
byte is decompressed, :func:`walk_frames` walks the file's frame and block headers
(3 bytes a block, read where they lie: the file is not read whole) so that a
truncated or foreign file is refused naming the offset, and the report can say
whether every frame carries its checksum (zstd's own, checked while decompressing).

:func:`zstd_kind` tells the kinds apart from a file's first and last bytes: a
seekable file ends with the seek table's magic; a plain one starts with a zstd
frame (or a skippable frame) and does not.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator

import zstandard

from ..errors import FormatError, IntegrityError
from ..format.identity import SKIPPABLE_MAGIC_BASE, is_zstd
from ..system.files import pread_exact
from .seek_table import (
    SEEK_TABLE_MAGIC,
    SEEKABLE_MAGIC,
    SKIPPABLE_HEADER_NBYTES,
    ContentFrame,
    FrameEntry,
    walk_zstd_frame,
)

__all__ = ["PlainFrames", "decompressed_pieces", "file_ends", "walk_frames", "zstd_kind"]

_U32 = struct.Struct("<I")


def zstd_kind(head: bytes, tail: bytes) -> str | None:
    """``"seekable"`` (ends with the seek table's magic), ``"plain"`` (starts with a
    zstd or skippable frame's magic) or None (not zstd), from a file's first and
    last 4 bytes."""
    if len(tail) == 4 and _U32.unpack(tail)[0] == SEEKABLE_MAGIC:
        return "seekable"
    return "plain" if is_zstd(head) else None


class PlainFrames:
    """What :func:`walk_frames` found: ``frames`` zstd frames (skippable ones not
    counted), whether ``all_checksums`` of them carry a checksum, the content size
    when every frame's header gives it (else None), and ptdstream's content frame
    (:class:`~ptdstream.pack.seek_table.ContentFrame`) when the file holds one: a
    packed file whose seek table was cut off."""

    def __init__(self, frames: int, all_checksums: bool, content_nbytes: int | None,
                 content: ContentFrame | None) -> None:
        self.frames, self.all_checksums, self.content_nbytes, self.content = frames, all_checksums, content_nbytes, \
            content


def walk_frames(name: str, fd: int, nbytes: int) -> PlainFrames:
    """Walk every frame of the plain zstd file open on ``fd`` (``nbytes`` bytes).

    Work: one small read per frame header and per block header (and ptdstream's
    60-byte content frame, where there is one).

    Raises:
        FormatError: a frame that is neither a zstd nor a skippable frame, or one
            that runs beyond the end of the file (truncated), naming the offset.
    """
    pos, frames, checksums = 0, 0, True
    content_nbytes: int | None = 0
    content = None
    while pos < nbytes:
        if nbytes - pos < SKIPPABLE_HEADER_NBYTES:
            raise FormatError(f"{name}: at offset {pos}: {nbytes - pos} bytes after the last frame, too few for a "
                              "frame: truncated, or not a zstd file")
        magic, size = struct.unpack("<II", _pread(name, fd, pos, SKIPPABLE_HEADER_NBYTES))
        if magic & ~0xF == SKIPPABLE_MAGIC_BASE:
            end = pos + SKIPPABLE_HEADER_NBYTES + size
            if end > nbytes:
                raise FormatError(f"{name}: at offset {pos}: a skippable frame of {SKIPPABLE_HEADER_NBYTES + size:,} "
                                  f"bytes runs beyond the end of the file ({nbytes:,} bytes): truncated")
            if magic == SEEK_TABLE_MAGIC and end == nbytes:  # a packed file's seek table, its last magic wrong
                (last,) = _U32.unpack(_pread(name, fd, nbytes - 4, 4))
                raise FormatError(f"{name}: at offset {nbytes - 4}: last 4 bytes are 0x{last:08X}, not the seekable "
                                  f"magic 0x{SEEKABLE_MAGIC:08X}: the seek table that ends the file is corrupt")
            if end - pos == ContentFrame.FRAME_NBYTES:
                entry = FrameEntry(frames, pos, end - pos, content_nbytes or 0, 0, None)  # names it in an error
                content = ContentFrame.from_frame(name, entry, _pread(name, fd, pos, end - pos)) or content
            pos = end
            continue
        try:
            extent, frame_content, has_checksum = walk_zstd_frame(_reader(name, fd, pos), nbytes - pos)
        except ValueError as e:
            what = "truncated" if "beyond" in str(e) or "needs" in str(e) else "not a zstd frame"
            raise FormatError(f"{name}: at offset {pos}: frame {frames}: {e} ({what})") from None
        frames += 1
        checksums = checksums and has_checksum
        content_nbytes = None if content_nbytes is None or frame_content is None else content_nbytes + frame_content
        pos += extent
    return PlainFrames(frames, checksums, content_nbytes, content)


def decompressed_pieces(name: str, fd: int, piece_nbytes: int) -> Iterator[bytes]:
    """The decompressed content of the plain zstd file open on ``fd``, across every
    frame, in pieces of at most ``piece_nbytes``. Memory: the decoder's window
    (zstd's limit: 128 MiB at most, as ``zstd -d`` by default) and one piece.

    Raises:
        IntegrityError: a frame does not decompress or fails its checksum.
    """
    with open(fd, "rb", closefd=False) as f:
        f.seek(0)
        reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True, read_size=piece_nbytes)
        try:
            while True:
                try:
                    data = reader.read(piece_nbytes)
                except zstandard.ZstdError as e:
                    raise IntegrityError(f"{name}: does not decompress: {e}; nothing was published") from None
                if not data:
                    return
                yield data
        finally:
            reader.close()


def file_ends(fd: int, nbytes: int) -> tuple[bytes, bytes]:
    """A file's first 8 and last 4 bytes (fewer when it is shorter)."""
    return os.pread(fd, 8, 0), os.pread(fd, 4, nbytes - 4) if nbytes >= 4 else b""


def _pread(name: str, fd: int, offset: int, nbytes: int) -> bytes:
    buffer = bytearray(nbytes)
    if pread_exact(fd, memoryview(buffer), offset) != nbytes:
        raise FormatError(f"{name}: at offset {offset}: the file ended before {nbytes} bytes (file changed?)")
    return bytes(buffer)


def _reader(name: str, fd: int, start: int) -> Callable[[int, int], bytes]:
    """``read_at(offset, nbytes)`` of the file from ``start`` on."""
    return lambda offset, nbytes: _pread(name, fd, start + offset, nbytes)
