"""``unpack``: a seekable zstd file back to the original bytes, every check made
before the file is published (through :class:`~ptdstream.write.sink.ChunkedFileSink`)."""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Tuple

from ..defaults import WINDOW_NBYTES
from ..errors import IntegrityError
from ..progress import progress_callback
from ..reports import Report
from ..sources.fingerprint import StreamingDigest
from ..write.sink import ChunkedFileSink
from .compress import rate_mbps
from .seek_table import MAX_FRAME_NBYTES
from .seekable import SeekableReader


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
    checks: Tuple[str, ...]
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
           window_nbytes: int = WINDOW_NBYTES, drop_pages: bool = True) -> UnpackReport:
    """Decompress the seekable zstd file ``source`` into ``target``, checking it all first.

    Frames are decoded in order, each checked against its zstd checksum and the
    seek table's sizes and checksum, the next one in a helper thread while this
    one is written; then the whole content against the manifest's size and
    xxh3-128, when there is one. Only then is ``target`` published (atomically,
    through :class:`ChunkedFileSink`).

    Memory: one compressed and two decompressed frames (about 3 x 8 MiB for files
    packed with the defaults; a frame is at most ``max_frame_nbytes``).

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
        sink = stack.enter_context(ChunkedFileSink(target, window_nbytes=window_nbytes, drop_pages=drop_pages))
        pool = ThreadPoolExecutor(1, thread_name_prefix="ptdstream-unpack")
        stack.callback(pool.shutdown, wait=True, cancel_futures=True)
        frames, digest = reader.table.frames, StreamingDigest()
        pending = pool.submit(reader.decode, frames[0], False) if frames else None
        for i in range(len(frames)):
            data = pending.result()
            # The reader is used by one thread at a time: the next decode starts
            # only after this one returned.
            pending = pool.submit(reader.decode, frames[i + 1], False) if i + 1 < len(frames) else None
            sink.write(data)
            digest.update(data)
            update(len(data))
        found = digest.finish()
        checks = _unpack_checks(reader, found.digest)
    return UnpackReport(reader.path, os.fspath(target), found.nbytes, reader.file_nbytes,
                        sum(1 for f in frames if f.nbytes), time.perf_counter() - start, checks, found.hex)


def _unpack_checks(reader: SeekableReader, digest: bytes) -> Tuple[str, ...]:
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
