"""``pack``: any file into the seekable zstd format (:mod:`ptdstream.pack.seek_table`).

Independent zstd frames, each with zstd's content size and checksum, then
ptdstream's content frame and the standard seek table. ``zstd -d`` decompresses
the result; seekable readers jump to any frame. Frames follow the pieces
ptdstream writes in: boundaries at multiples of ``frame_nbytes`` (8 MiB) of the
original file, plus one at the end of the .pte/.ptd metadata (header +
flatbuffer), so reading the section map decompresses only the metadata.
"""

from __future__ import annotations

import collections
import contextlib
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zstandard

from ..defaults import CHUNK_NBYTES, WINDOW_NBYTES
from ..errors import IntegrityError, LayoutError
from ..format.identity import (
    HEAD_NBYTES,
    HEADER_OFFSET,
    PTD_IDENTIFIER_PREFIX,
    PTE_IDENTIFIER_PREFIX,
    ExtendedHeader,
    FlatTensorHeader,
)
from ..progress import progress_callback
from ..reports import Report, rate
from ..sources.fingerprint import StreamingDigest
from ..system.files import open_input_fd, pread_exact
from ..write.stream_sink import open_sink, target_name
from .seek_table import EMPTY_CHECKSUM, MAX_FRAME_NBYTES, MAX_FRAMES, ContentFrame, encode_seek_table, frame_checksum

__all__ = ["DEFAULT_LEVEL", "PackReport", "artifact_head", "pack", "plan_frames", "rate_mbps", "speed_text"]

#: Default zstd level, the ``zstd`` command's default.
DEFAULT_LEVEL = 3
_local = threading.local()


def speed_text(nbytes: int, seconds: float) -> str:
    """`` (123 MB/s)`` of original content for a summary, or ``""`` below
    :data:`~ptdstream.reports.RATE_MIN_NBYTES` (64 MiB), where it would not mean throughput."""
    speed = rate(nbytes, seconds, "MB/s")
    return f" ({speed})" if speed else ""


def rate_mbps(nbytes: int, seconds: float) -> float:
    """MB/s (10^6 bytes a second); 0 for a zero duration."""
    return nbytes / seconds / 1e6 if seconds > 0 else 0.0


@dataclass(frozen=True)
class PackReport(Report):
    """What :func:`pack` wrote. Sizes in bytes, ``seconds`` wall time;
    ``content_xxh3_128`` hex digest of the input; ``kind`` "pte", "ptd" or ""."""

    source: str
    target: str
    kind: str
    nbytes: int
    packed_nbytes: int
    frames: int
    level: int
    frame_nbytes: int
    head_nbytes: int
    seconds: float
    content_xxh3_128: str

    derived = ("ratio", "mbps")

    @property
    def mbps(self) -> float:
        """MB/s (10^6 bytes a second) of original content."""
        return rate_mbps(self.nbytes, self.seconds)

    @property
    def ratio(self) -> float:
        """Bytes in over bytes packed."""
        return self.nbytes / self.packed_nbytes

    def summary(self) -> str:
        return (f"packed {self.source} ({self.kind or 'file'}, {self.nbytes:,} bytes) -> {self.target}: "
                f"{self.packed_nbytes:,} bytes, ratio {self.ratio:.3f}, {self.frames} frames, level "
                f"{self.level}, {self.seconds:.2f} s{speed_text(self.nbytes, self.seconds)}")


def plan_frames(nbytes: int, frame_nbytes: int = CHUNK_NBYTES, head_nbytes: int = 0) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of each frame: boundaries at multiples of ``frame_nbytes``
    and at ``head_nbytes`` (ignored when 0 or >= ``nbytes``). The last frame may be shorter.

    Raises:
        LayoutError: ``frame_nbytes`` outside [1, 1 GiB], or more than 2^27 frames.
    """
    if not 1 <= frame_nbytes <= MAX_FRAME_NBYTES:
        raise LayoutError(f"frame size {frame_nbytes} bytes is outside [1, {MAX_FRAME_NBYTES}] (the seekable "
                          "format's limit); pass a frame size such as 8 MiB")
    count = -(-nbytes // frame_nbytes) + 2  # + the head cut + the manifest
    if count > MAX_FRAMES:
        raise LayoutError(f"{nbytes} bytes in frames of {frame_nbytes} bytes make about {count} frames, more "
                          f"than the seekable format's {MAX_FRAMES}; use a larger frame size")
    cuts = set(range(0, nbytes, frame_nbytes)) | ({head_nbytes} if 0 < head_nbytes < nbytes else set())
    bounds = sorted(cuts) + [nbytes]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False)]


def artifact_head(head: bytes, nbytes: int) -> tuple[str, int]:
    """``(kind, head_nbytes)`` from a file's first 64 bytes: ``"pte"``/``"ptd"`` and the
    end of its metadata (header + flatbuffer) when the header fields fit the file;
    ``("", 0)`` for other files. A hint for frame boundaries only; nothing is trusted."""
    prefix = head[4:6]
    if prefix == PTE_IDENTIFIER_PREFIX:
        eh = ExtendedHeader.from_bytes(head[HEADER_OFFSET:])
        if eh is None:  # no extended header: the whole file is the program flatbuffer
            return "pte", nbytes
        return "pte", eh.program_size if eh.program_size <= nbytes else 0
    if prefix == PTD_IDENTIFIER_PREFIX:
        fh = FlatTensorHeader.from_bytes(head[HEADER_OFFSET:])
        end = fh.flatbuffer_offset + fh.flatbuffer_size if fh is not None else 0
        return "ptd", end if end <= nbytes else 0
    return "", 0


def _compress(view: memoryview, level: int, verify: bool) -> tuple[bytes, int]:
    """One frame (runs in a worker thread, one compressor per thread and level)."""
    cctx = getattr(_local, "cctx", None)
    if cctx is None or _local.level != level:
        cctx = _local.cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
        _local.level = level
    data = cctx.compress(view)
    if verify and (zstandard.ZstdDecompressor().decompress(data) != view or data[-4:] != struct.pack(
            "<I", frame_checksum(view))):
        raise IntegrityError(f"frame of {len(view)} bytes does not decompress to its input (compressor fault)")
    return data, int.from_bytes(data[-4:], "little")  # zstd's trailer: XXH64 low 32 bits of ``view``


def _read_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = pread_exact(fd, view, offset)
    if done < len(view):
        raise IntegrityError(f"{path}: ended at offset {offset + done} while packing (file shrank?); "
                             "nothing was published")


def pack(source: str, target: str, *, level: int = DEFAULT_LEVEL, frame_nbytes: int = CHUNK_NBYTES,
         threads: int = 1, checksums: bool = True, verify: bool = False, progress=False,
         window_nbytes: int = WINDOW_NBYTES, drop_pages: bool = True) -> PackReport:
    """Compress the file ``source`` into the seekable zstd file ``target``: a path
    (published atomically) or an open binary stream (bytes written as they come).

    Args:
        level: zstd level (-7..22; 3 like the ``zstd`` command).
        frame_nbytes: frame size in bytes (8 MiB); the last frame may be shorter.
        threads: frames compressed at once, each in its own thread; the output
            does not depend on it.
        checksums: store each frame's XXH64 low 32 bits in the seek table.
        verify: decompress each frame right after compressing it and compare.
        progress: ``True`` for a tqdm bar on stderr, or a callable taking bytes done.
        window_nbytes, drop_pages: for an output file's sink; input
            pages are dropped after reading when ``drop_pages``.

    Memory: ``threads + 1`` input buffers of ``frame_nbytes`` (allocated once,
    reused), up to ``threads + 1`` compressed frames, one zstd context a thread.

    Raises:
        LayoutError: a bad level, frame size or thread count (nothing created).
        IntegrityError: ``source`` changed size while being read (nothing published).
        OSError: ``source`` unreadable, or a write, fsync or rename failed
            (nothing published; the temp file is removed).
    """
    if not -7 <= level <= 22:
        raise LayoutError(f"zstd level {level} is outside [-7, 22]")
    if threads < 1:
        raise LayoutError(f"threads {threads} is below 1: give at least one compression thread")
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        fd = open_input_fd(os.fspath(source))
        stack.callback(os.close, fd)
        nbytes = os.fstat(fd).st_size
        kind, head_nbytes = artifact_head(os.pread(fd, HEAD_NBYTES, 0), nbytes)
        frames = plan_frames(nbytes, frame_nbytes, head_nbytes)
        update = progress_callback(stack, progress, nbytes, f"packing {os.path.basename(source)}")
        sink = stack.enter_context(open_sink(target, window_nbytes=window_nbytes, drop_pages=drop_pages))
        pool = ThreadPoolExecutor(threads, thread_name_prefix="ptdstream-pack")
        stack.callback(pool.shutdown, wait=True, cancel_futures=True)
        free = [bytearray(min(frame_nbytes, nbytes)) for _ in range(min(threads + 1, len(frames)))]
        inflight: collections.deque = collections.deque()
        digest, entries = StreamingDigest(), []

        def finish_oldest() -> None:
            future, buf, n = inflight.popleft()
            data, checksum = future.result()
            sink.write(data)
            entries.append((len(data), n, checksum))
            free.append(buf)
            update(n)

        for offset, n in frames:
            if not free:
                finish_oldest()
            buf = free.pop()
            view = memoryview(buf)[:n]
            _read_exact(fd, view, offset, source)
            if drop_pages and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
            digest.update(view)
            inflight.append((pool.submit(_compress, view, level, verify), buf, n))
        while inflight:
            finish_oldest()
        if os.fstat(fd).st_size != nbytes:
            raise IntegrityError(f"{source}: size changed from {nbytes} to {os.fstat(fd).st_size} bytes "
                                 "while packing; nothing was published")
        content = digest.finish()
        trailer = ContentFrame(nbytes, content.digest, frame_nbytes, head_nbytes).to_frame()
        entries.append((len(trailer), 0, EMPTY_CHECKSUM))
        sink.write(trailer)
        sink.write(encode_seek_table(entries, checksums))
        packed_nbytes = sink.nbytes
    return PackReport(os.fspath(source), target_name(target), kind, nbytes, packed_nbytes, len(frames), level,
                      frame_nbytes, head_nbytes, time.perf_counter() - start, content.hex)
