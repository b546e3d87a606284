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
from ..errors import IntegrityError
from ..progress import progress_callback
from ..reports import Report
from ..sources.fingerprint import StreamingDigest
from ..write.stream_sink import open_sink, target_name
from .compress import rate_mbps
from .seek_table import MAX_FRAME_NBYTES
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

    derived = ("mbps",)

    @property
    def mbps(self) -> float:
        """MB/s (10^6 bytes a second) of original content."""
        return rate_mbps(self.nbytes, self.seconds)

    def summary(self) -> str:
        checked = ", ".join(self.checks) if self.checks else "NOTHING (the file carries no checksums)"
        return (f"unpacked {self.source} -> {self.target}: {self.nbytes:,} bytes from {self.frames} frames, "
                f"{self.seconds:.2f} s ({self.mbps:.0f} MB/s); verified: {checked}")


def unpack(source: str, target: str, *, progress=False, max_frame_nbytes: int = MAX_FRAME_NBYTES,
           window_nbytes: int = WINDOW_NBYTES, drop_pages: bool = True,
           piece_nbytes: int = CHUNK_NBYTES) -> UnpackReport:
    """Decompress the seekable zstd file ``source`` into ``target``, checking it all first.

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
        FormatError: ``source`` is truncated, not in the seekable format, or its seek
            table disagrees with its frames (names file, frame index and offset).
        IntegrityError: a frame does not decompress or fails a checksum, or the
            content does not match the manifest. In both cases nothing is published.
        OSError: ``source`` unreadable, or writing ``target`` failed (nothing published).
    """
    start = time.perf_counter()
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
