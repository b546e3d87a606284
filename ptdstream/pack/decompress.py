"""``unpack``: a seekable zstd file back to the original bytes, every check made
before the file is published (through :class:`~ptdstream.write.sink.ChunkedFileSink`)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..defaults import CHUNK_NBYTES, WINDOW_NBYTES
from ..errors import FormatError, IntegrityError
from ..progress import progress_callback
from ..reports import Report
from ..sources.fingerprint import StreamingDigest
from ..system.files import open_input_fd
from ..write.stream_sink import open_sink, target_name
from .compress import rate_mbps, speed_text
from .plain import decompressed_pieces, file_ends, walk_frames, zstd_kind
from .seek_table import MAX_FRAME_NBYTES, not_zstd_message
from .seekable import SeekableReader

__all__ = ["UnpackReport", "unpack"]


@dataclass(frozen=True)
class UnpackReport(Report):
    """What :func:`unpack` wrote and which checks passed (``checks``), e.g.
    ``("zstd frame checksums", "seek table checksums", "content xxh3-128")``."""

    source: str
    target: str
    nbytes: int
    packed_nbytes: int
    frames: int
    seconds: float
    checks: tuple[str, ...]
    content_xxh3_128: str
    #: A plain zstd file (no seek table: any zstd tool's), streamed from its first frame to its last.
    plain: bool = False

    derived = ("mbps",)

    @property
    def mbps(self) -> float:
        """MB/s (10^6 bytes a second) of original content."""
        return rate_mbps(self.nbytes, self.seconds)

    def summary(self) -> str:
        checked = ", ".join(self.checks) if self.checks else "NOTHING (the file carries no checksums)"
        frames = f"{self.frames} frame{'s' * (self.frames != 1)}"
        plain = " of a plain zstd file (no seek table: streamed)" if self.plain else ""
        return (f"unpacked {self.source} -> {self.target}: {self.nbytes:,} bytes from {frames}{plain}, "
                f"{self.seconds:.2f} s{speed_text(self.nbytes, self.seconds)}; verified: {checked}")


def unpack(source: str, target: str, *, progress=False, max_frame_nbytes: int = MAX_FRAME_NBYTES,
           window_nbytes: int = WINDOW_NBYTES, drop_pages: bool = True,
           piece_nbytes: int = CHUNK_NBYTES) -> UnpackReport:
    """Decompress the seekable zstd file ``source`` into ``target``, checking it all first;
    a plain zstd file (any zstd tool's, no seek table) is streamed as ``zstd -d`` does.

    Frames are decoded in order, each checked against its zstd checksum and the
    seek table's sizes and checksum, the next one in a helper thread while this
    one is written; then the whole content against the manifest's size and
    xxh3-128, when there is one. Only then is ``target`` published (atomically,
    through :class:`~ptdstream.write.sink.ChunkedFileSink`). ``target`` may also be
    an open binary stream (stdout): it then gets each frame's bytes once that frame
    is checked, and the whole-content check is made at the end.

    Memory: one compressed frame and two decompressed pieces of at most
    ``piece_nbytes`` (8 MiB): frames up to that size are decoded whole, larger
    ones (up to ``max_frame_nbytes``) in pieces, so a 1 GiB frame of zeros in a
    32 KB file costs about 16 MiB, not 2 GiB.

    Raises:
        FormatError: ``source`` is not zstd (a .pte/.ptd itself, or another file: the
            message says which), is truncated, or its seek table disagrees with its
            frames (names file, frame index and offset).
        IntegrityError: a frame does not decompress or fails a checksum, or the
            content does not match the manifest. In both cases nothing is published.
        OSError: ``source`` unreadable, or writing ``target`` failed (nothing published).
    """
    start = time.perf_counter()
    kind, head = _kind(source)
    if kind is None:
        raise FormatError(not_zstd_message(os.fspath(source), head))
    if kind == "plain":
        return _unpack_plain(os.fspath(source), target, start, progress=progress, window_nbytes=window_nbytes,
                             drop_pages=drop_pages, piece_nbytes=piece_nbytes)
    with contextlib.ExitStack() as stack:
        reader = stack.enter_context(SeekableReader(source, max_frame_nbytes=max_frame_nbytes, drop_pages=drop_pages))
        update = progress_callback(stack, progress, reader.nbytes, f"unpacking {os.path.basename(source)}")
        sink = stack.enter_context(open_sink(target, window_nbytes=window_nbytes, drop_pages=drop_pages))
        pool = ThreadPoolExecutor(1, thread_name_prefix="ptdstream-unpack")
        stack.callback(pool.shutdown, wait=True, cancel_futures=True)
        frames, digest = reader.table.frames, StreamingDigest()

        def small(i: int) -> bool:
            return i < len(frames) and frames[i].nbytes <= piece_nbytes

        # Frames of at most piece_nbytes are decoded whole, the next in a helper
        # thread while this one is written; a larger frame (up to the format's
        # 1 GiB) is decoded in pieces of piece_nbytes, never whole.
        pending = pool.submit(reader.decode, frames[0], False) if small(0) else None
        for i in range(len(frames)):
            if pending is not None:
                pieces: Iterable[bytes] = [pending.result()]
                # The reader is used by one thread at a time: the next decode
                # starts only after this one returned.
                pending = pool.submit(reader.decode, frames[i + 1], False) if small(i + 1) else None
            else:
                pieces = reader.iter_decoded(frames[i], piece_nbytes)
            for data in pieces:
                sink.write(data)
                digest.update(data)
                update(len(data))
            if pending is None and small(i + 1):
                pending = pool.submit(reader.decode, frames[i + 1], False)
        found = digest.finish()
        checks = _unpack_checks(reader, found.digest)
    return UnpackReport(reader.path, target_name(target), found.nbytes, reader.file_nbytes,
                        sum(1 for f in frames if f.nbytes), time.perf_counter() - start, checks, found.hex)


def _kind(source: str) -> tuple[str | None, bytes]:
    """:func:`~ptdstream.pack.plain.zstd_kind` of the file ``source``, and its first bytes."""
    fd = open_input_fd(source)
    try:
        head, tail = file_ends(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return zstd_kind(head[:4], tail), head


def _unpack_plain(source: str, target, start: float, *, progress, window_nbytes: int, drop_pages: bool,
                  piece_nbytes: int) -> UnpackReport:
    """A plain zstd file (no seek table) streamed into ``target``, as ``zstd -d`` does:
    walked first (:func:`~ptdstream.pack.plain.walk_frames`), then decompressed across
    its frames, each frame's checksum checked where it carries one."""
    with contextlib.ExitStack() as stack:
        fd = open_input_fd(source)
        stack.callback(os.close, fd)
        file_nbytes = os.fstat(fd).st_size
        walked = walk_frames(source, fd, file_nbytes)
        update = progress_callback(stack, progress, walked.content_nbytes, f"unpacking {os.path.basename(source)}")
        sink = stack.enter_context(open_sink(target, window_nbytes=window_nbytes, drop_pages=drop_pages))
        digest = StreamingDigest()
        for data in decompressed_pieces(source, fd, piece_nbytes):
            sink.write(data)
            digest.update(data)
            update(len(data))
        found = digest.finish()
        checks: tuple[str, ...] = ("zstd frame checksums",) if walked.all_checksums else ()
        if walked.content is not None:  # a packed file without its seek table: the content still checked
            if (found.nbytes, found.digest) != (walked.content.content_nbytes, walked.content.content_xxh3_128):
                raise IntegrityError(f"{source}: the decompressed content ({found.nbytes:,} bytes, xxh3-128 "
                                     f"{found.hex}) is not what its ptdstream manifest says ("
                                     f"{walked.content.content_nbytes:,} bytes, "
                                     f"{walked.content.content_xxh3_128.hex()}); nothing was published")
            checks += ("content xxh3-128",)
    return UnpackReport(source, target_name(target), found.nbytes, file_nbytes, walked.frames,
                        time.perf_counter() - start, checks, found.hex, plain=True)


def _unpack_checks(reader: SeekableReader, digest: bytes) -> tuple[str, ...]:
    checks = []
    if reader.all_frames_have_checksums:
        checks.append("zstd frame checksums")
    if reader.table.checksums:
        checks.append("seek table checksums")
    if reader.content is not None:
        if digest != reader.content.content_xxh3_128:
            raise IntegrityError(f"{reader.path}: the decompressed content's xxh3-128 is {digest.hex()}, the "
                                 f"manifest says {reader.content.content_xxh3_128.hex()}; nothing was published")
        checks.append("content xxh3-128")
    return tuple(checks)
