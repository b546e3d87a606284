"""Random access to the content of a seekable zstd file, frame by frame, every frame checked.

:class:`SeekableReader` trusts no size field: the seek table is checked against the
file size (:func:`~ptdstream.pack.seek_table.read_seek_table`); a frame's extent and
its header's content size must equal the table's before it is decompressed.
Structure that disagrees raises :class:`~ptdstream.errors.FormatError`; content
that does not decode or match a checksum raises
:class:`~ptdstream.errors.IntegrityError`. Both name the file, the frame index and
the frame's offset in the packed file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import xxhash
import zstandard

from ..defaults import CHUNK_NBYTES
from ..errors import FormatError, IntegrityError, StateError
from ..system.files import open_input_fd, pread_exact
from ..system.pagecache import drop_pages
from .seek_table import (
    MAX_FRAME_NBYTES,
    SKIPPABLE_HEADER_NBYTES,
    SKIPPABLE_MAGIC_BASE,
    ContentFrame,
    FrameEntry,
    frame_checksum,
    read_seek_table,
    zstd_frame_extent,
)

__all__ = ["SeekableReader"]


class SeekableReader:
    """Random access to the content of a seekable zstd file, frame by frame.

    Calls: 1) the constructor opens the file, checks its seek table and reads the
    content frame, if any; 2) :meth:`decode`, :meth:`read_at`, :meth:`iter_range` any
    number of times; 3) :meth:`close` (idempotent; also on leaving a ``with``).
    Memory: the seek table, one compressed frame buffer (reused, grown to the
    largest frame read) and, with ``cache``, the last decoded frame. Not
    thread-safe (one thread at a time may use it).

    Raises (from every method): FormatError, IntegrityError (see the module
    docstring); OSError when the file cannot be read; StateError after close.
    """

    def __init__(self, path: str, *, max_frame_nbytes: int = MAX_FRAME_NBYTES, drop_pages: bool = True) -> None:
        self.path = os.fspath(path)
        self.drop_pages = drop_pages
        self._fd: int | None = open_input_fd(self.path)
        try:
            self.file_nbytes = os.fstat(self._fd).st_size
            self.table = read_seek_table(self.path, self.file_nbytes, self._pread, max_frame_nbytes)
            self.content = self._read_content_frame()
        except BaseException:
            self.close()
            raise
        self._dctx = zstandard.ZstdDecompressor()
        self._buffer = bytearray()
        self._cached: tuple[int, bytes] = (-1, b"")
        #: Frames decompressed so far (cache hits excluded).
        self.frames_decoded = 0
        #: False once a zstd frame without its own checksum was decoded.
        self.all_frames_have_checksums = True

    @property
    def nbytes(self) -> int:
        """Bytes of decompressed content."""
        return self.table.nbytes

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._fd is None

    def _check_open(self) -> int:
        if self._fd is None:
            raise StateError(f"reader of {self.path} is closed")
        return self._fd

    def _pread(self, offset: int, nbytes: int) -> bytes:
        data = os.pread(self._check_open(), nbytes, offset)
        if len(data) != nbytes:
            raise FormatError(f"{self.path}: at offset {offset}: read {len(data)} of {nbytes} bytes (file changed?)")
        return data

    def _read_content_frame(self) -> ContentFrame | None:
        frames = self.table.frames
        last = frames[-1] if frames else None
        if last is None or last.nbytes or last.compressed_nbytes != ContentFrame.FRAME_NBYTES:
            return None
        found = ContentFrame.from_frame(self.path, last, self._pread(last.compressed_offset, last.compressed_nbytes))
        if found is not None and found.content_nbytes != self.table.nbytes:
            raise FormatError(f"{last.where(self.path)}: manifest says {found.content_nbytes} content bytes, "
                              f"the seek table's frames add up to {self.table.nbytes}")
        return found

    def _read_frame(self, entry: FrameEntry) -> memoryview:
        fd = self._check_open()
        if len(self._buffer) < entry.compressed_nbytes:
            self._buffer = bytearray(entry.compressed_nbytes)
        view = memoryview(self._buffer)[: entry.compressed_nbytes]
        done = pread_exact(fd, view, entry.compressed_offset)
        if done < len(view):
            raise FormatError(f"{entry.where(self.path)}: file ends at offset {entry.compressed_offset + done}")
        if self.drop_pages:
            drop_pages(fd, entry.compressed_offset, entry.compressed_nbytes)
        return view

    def decode(self, entry: FrameEntry, cache: bool = True) -> bytes:
        """The decompressed bytes of frame ``entry`` (empty for a skippable frame),
        checked against the seek table and the frame's own checksum and sizes.
        Allocates ``entry.nbytes`` bytes; kept for the next call when ``cache``."""
        if self._cached[0] == entry.index:
            return self._cached[1]
        data = self._read_frame(entry)
        where = entry.where(self.path)
        magic = int.from_bytes(data[:4], "little")
        if magic & 0xFFFFFFF0 == SKIPPABLE_MAGIC_BASE:
            size = int.from_bytes(data[4:8], "little")
            if size + SKIPPABLE_HEADER_NBYTES != entry.compressed_nbytes or entry.nbytes:
                raise FormatError(f"{where}: skippable frame of {size + 8} bytes; the seek table says "
                                  f"{entry.compressed_nbytes} bytes, {entry.nbytes} decompressed")
            out, extent, has_checksum = b"", 0, False
        else:
            extent, has_checksum = self._check_frame(entry, data, where)
            out = self._decompress(entry, data, where)
        if entry.checksum is not None:
            # zstd has checked its trailer against XXH64 of ``out``: the same value.
            found = int.from_bytes(data[extent - 4 : extent], "little") if has_checksum else frame_checksum(out)
            if found != entry.checksum:
                raise IntegrityError(f"{where}: seek table checksum 0x{entry.checksum:08X}, decompressed bytes "
                                     f"give 0x{found:08X}: the file is corrupt; fetch or pack it again")
        self.frames_decoded += 1
        self._cached = (entry.index, out) if cache else (-1, b"")
        return out

    def _check_frame(self, entry: FrameEntry, data: memoryview, where: str) -> tuple[int, bool]:
        """``(extent, has checksum)`` of the zstd frame in ``data``, after checking its
        extent and its header's content size against the seek table ``entry``.

        Raises:
            FormatError: not a zstd frame, or one that disagrees with the seek table.
        """
        try:
            extent, content, has_checksum = zstd_frame_extent(data)
        except ValueError as e:
            raise FormatError(f"{where}: not a zstd frame of the seek table's size: {e}") from None
        if extent != entry.compressed_nbytes:
            raise FormatError(f"{where}: the zstd frame is {extent} bytes, the seek table says "
                              f"{entry.compressed_nbytes}")
        if content is not None and content != entry.nbytes:
            raise FormatError(f"{where}: frame header says {content} decompressed bytes, "
                              f"the seek table says {entry.nbytes}")
        self.all_frames_have_checksums &= has_checksum
        return extent, has_checksum

    def _decompress(self, entry: FrameEntry, data: memoryview, where: str) -> bytes:
        try:
            if entry.nbytes == 0:
                obj = self._dctx.decompressobj()
                out = obj.decompress(data)
                ok = obj.eof and not obj.unused_data
            else:
                out = self._dctx.decompress(data, max_output_size=entry.nbytes, allow_extra_data=False)
                ok = True
        except zstandard.ZstdError as e:
            raise IntegrityError(f"{where}: does not decompress ({e}): the file is corrupt; fetch or pack it "
                                 "again") from None
        if not ok or len(out) != entry.nbytes:
            raise IntegrityError(f"{where}: decompressed to {len(out)} bytes, the seek table says {entry.nbytes}")
        return out

    def iter_decoded(self, entry: FrameEntry, piece_nbytes: int) -> Iterator[bytes]:
        """The decompressed bytes of frame ``entry`` in pieces of at most
        ``piece_nbytes`` bytes, with every check of :meth:`decode` (sizes, the
        frame's own checksum, the seek table's checksum, computed as the pieces
        go). Memory: the compressed frame and one piece, whatever the frame's
        decompressed size (a 1 GiB frame of zeros in a few KB is decoded in
        pieces, never whole). A frame no larger than ``piece_nbytes`` is decoded
        by :meth:`decode`. Raises as :meth:`decode`; an error may come after some
        pieces were yielded (the caller publishes nothing then)."""
        if entry.nbytes <= piece_nbytes:
            yield self.decode(entry, cache=False)
            return
        data = self._read_frame(entry)
        where = entry.where(self.path)
        extent, has_checksum = self._check_frame(entry, data, where)
        running = xxhash.xxh64()
        total = 0
        try:
            with self._dctx.stream_reader(data, read_size=min(len(data), 1 << 20) or 1) as reader:
                while True:
                    piece = reader.read(piece_nbytes)
                    if not piece:
                        break
                    total += len(piece)
                    if total > entry.nbytes:
                        break
                    running.update(piece)
                    yield piece
        except zstandard.ZstdError as e:
            raise IntegrityError(f"{where}: does not decompress ({e}): the file is corrupt; fetch or pack it "
                                 "again") from None
        if total != entry.nbytes:
            raise IntegrityError(f"{where}: decompressed to {'more than ' if total > entry.nbytes else ''}"
                                 f"{total} bytes, the seek table says {entry.nbytes}")
        found = running.intdigest() & 0xFFFFFFFF
        if entry.checksum is not None and found != entry.checksum:
            raise IntegrityError(f"{where}: seek table checksum 0x{entry.checksum:08X}, decompressed bytes "
                                 f"give 0x{found:08X}: the file is corrupt; fetch or pack it again")
        self.frames_decoded += 1

    def iter_range(self, offset: int, nbytes: int) -> Iterator[memoryview]:
        """Content bytes ``[offset, offset + nbytes)`` as consecutive pieces, one per
        frame touched; decodes only those frames."""
        self._check_open()
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise FormatError(f"{self.path}: content range [{offset}, {offset + nbytes}) lies beyond the "
                              f"{self.nbytes} decompressed bytes")
        for entry in self.table.covering(offset, nbytes):
            lo, hi = max(offset, entry.offset) - entry.offset, min(offset + nbytes, entry.end) - entry.offset
            if entry.nbytes <= CHUNK_NBYTES:
                yield memoryview(self.decode(entry))[lo:hi]
                continue
            # A large frame is decoded in pieces; the whole frame is still decoded
            # (its checksums cover all of it), only the asked range is kept.
            at = 0
            for piece in self.iter_decoded(entry, CHUNK_NBYTES):
                a, b = max(lo, at), min(hi, at + len(piece))
                if a < b:
                    yield memoryview(piece)[a - at : b - at]
                at += len(piece)

    def read_at(self, offset: int, nbytes: int) -> bytes:
        """Content bytes ``[offset, offset + nbytes)`` (allocates ``nbytes``, plus
        one 8 MiB piece of a frame larger than that)."""
        return b"".join(self.iter_range(offset, nbytes))

    def close(self) -> None:
        """Close the file; idempotent."""
        fd, self._fd = getattr(self, "_fd", None), None
        self._cached = (-1, b"")
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> SeekableReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
