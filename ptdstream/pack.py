"""Compressed transport: pack / unpack / extract in the seekable zstd format.

* :func:`pack`: any file (a .pte/.ptd or not) -> independent zstd frames, each
  with zstd's content size and checksum, then ptdstream's manifest frame and the
  standard seek table (:mod:`ptdstream.seekable`). ``zstd -d`` decompresses the
  result; seekable readers jump to any frame.
* :func:`unpack`: back to the original bytes through :class:`ChunkedFileSink`,
  frame by frame, every check made before the file is published.
* :class:`PackedArtifact`: one key's or one segment's bytes from a packed
  .pte/.ptd, decompressing only the frames of the metadata head and of that segment.
* :func:`add_pack_commands`: the ``pack``, ``unpack`` and ``extract`` subcommands.

Frames follow the pieces ptdstream writes in: frame boundaries lie at multiples
of ``frame_nbytes`` (8 MiB) of the original file, plus one at the end of the
.pte/.ptd metadata (header + flatbuffer), so reading the section map
decompresses only the metadata.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Tuple

import zstandard

from .errors import IntegrityError, LayoutError, MissingKeyError
from .fingerprint import StreamingDigest
from .layout import HEADER_OFFSET, ExtendedHeader, FlatTensorHeader
from .reader import HEAD_NBYTES, Artifact, Segment, parse_artifact
from .seekable import (EMPTY_CHECKSUM, MAX_FRAME_NBYTES, MAX_FRAMES, Manifest, SeekableReader,
                       encode_seek_table, frame_checksum)
from .sink import DEFAULT_WINDOW_NBYTES, ChunkedFileSink
from .sources import pread_exact

#: Default frame size: 8 MiB, ptdstream's piece size.
DEFAULT_FRAME_NBYTES = 8 << 20
#: Default zstd level, the ``zstd`` command's default.
DEFAULT_LEVEL = 3
_local = threading.local()


class _Report:
    """``summary()`` for humans, ``to_json()`` with the derived rates."""

    def to_json(self) -> str:
        extra = {k: getattr(self, k) for k in ("ratio", "mbps") if hasattr(type(self), k)}
        return json.dumps(dict(asdict(self), **extra), indent=2)

    @property
    def mbps(self) -> float:
        """MB/s (10^6 bytes a second) of original content."""
        return self.nbytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class PackReport(_Report):
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

    @property
    def ratio(self) -> float:
        return self.nbytes / self.packed_nbytes

    def summary(self) -> str:
        return (f"packed {self.source} ({self.kind or 'file'}, {self.nbytes:,} bytes) -> {self.target}: "
                f"{self.packed_nbytes:,} bytes, ratio {self.ratio:.3f}, {self.frames} frames, level "
                f"{self.level}, {self.seconds:.2f} s ({self.mbps:.0f} MB/s)")


@dataclass(frozen=True)
class UnpackReport(_Report):
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

    def summary(self) -> str:
        checked = ", ".join(self.checks) if self.checks else "NOTHING (the file carries no checksums)"
        return (f"unpacked {self.source} -> {self.target}: {self.nbytes:,} bytes from {self.frames} frames, "
                f"{self.seconds:.2f} s ({self.mbps:.0f} MB/s); verified: {checked}")


def plan_frames(nbytes: int, frame_nbytes: int = DEFAULT_FRAME_NBYTES, head_nbytes: int = 0) -> List[Tuple[int, int]]:
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
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def artifact_head(head: bytes, nbytes: int) -> Tuple[str, int]:
    """``(kind, head_nbytes)`` from a file's first 64 bytes: ``"pte"``/``"ptd"`` and the
    end of its metadata (header + flatbuffer) when the header fields fit the file;
    ``("", 0)`` for other files. A hint for frame boundaries only; nothing is trusted."""
    ident = head[4:6]
    if ident == b"ET":
        eh = ExtendedHeader.from_bytes(head[HEADER_OFFSET:])
        if eh is None:  # no extended header: the whole file is the program flatbuffer
            return "pte", nbytes
        return "pte", eh.program_size if eh.program_size <= nbytes else 0
    if ident == b"FT":
        fh = FlatTensorHeader.from_bytes(head[HEADER_OFFSET:])
        end = fh.flatbuffer_offset + fh.flatbuffer_size if fh is not None else 0
        return "ptd", end if end <= nbytes else 0
    return "", 0


def _compress(view: memoryview, level: int, verify: bool) -> Tuple[bytes, int]:
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


def pack(source: str, target: str, *, level: int = DEFAULT_LEVEL, frame_nbytes: int = DEFAULT_FRAME_NBYTES,
         threads: int = 1, checksums: bool = True, verify: bool = False, progress=False,
         window_nbytes: int = DEFAULT_WINDOW_NBYTES, drop_pages: bool = True) -> PackReport:
    """Compress the file ``source`` into the seekable zstd file ``target``.

    Args:
        level: zstd level (-7..22; 3 like the ``zstd`` command).
        frame_nbytes: frame size in bytes (8 MiB); the last frame may be shorter.
        threads: frames compressed at once, each in its own thread; the output
            does not depend on it.
        checksums: store each frame's XXH64 low 32 bits in the seek table.
        verify: decompress each frame right after compressing it and compare.
        progress: ``True`` for a tqdm bar on stderr, or a callable taking bytes done.
        window_nbytes, drop_pages: for the output :class:`ChunkedFileSink`; input
            pages are dropped after reading when ``drop_pages``.

    Memory: ``threads + 1`` input buffers of ``frame_nbytes`` (allocated once,
    reused), up to ``threads + 1`` compressed frames, one zstd context a thread.

    Raises:
        LayoutError: a bad level, frame size or thread count (nothing created).
        IntegrityError: ``source`` changed size while being read (nothing published).
        OSError: ``source`` unreadable, or a write, fsync or rename failed
            (nothing published; the temp file is removed).
    """
    if not -7 <= level <= 22 or threads < 1:
        raise LayoutError(f"level {level} is outside [-7, 22] or threads {threads} < 1")
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        fd = os.open(os.fspath(source), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        stack.callback(os.close, fd)
        nbytes = os.fstat(fd).st_size
        kind, head_nbytes = artifact_head(os.pread(fd, HEAD_NBYTES, 0), nbytes)
        frames = plan_frames(nbytes, frame_nbytes, head_nbytes)
        update = _progress(stack, progress, nbytes, f"packing {os.path.basename(source)}")
        sink = stack.enter_context(ChunkedFileSink(target, window_nbytes=window_nbytes, drop_pages=drop_pages))
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
        manifest = Manifest(nbytes, content.digest, frame_nbytes, head_nbytes).to_frame()
        entries.append((len(manifest), 0, EMPTY_CHECKSUM))
        sink.write(manifest)
        sink.write(encode_seek_table(entries, checksums))
        packed_nbytes = sink.nbytes
    return PackReport(os.fspath(source), os.fspath(target), kind, nbytes, packed_nbytes, len(frames), level,
                      frame_nbytes, head_nbytes, time.perf_counter() - start, content.hex)


def _progress(stack: contextlib.ExitStack, progress, total: int, desc: str) -> Callable[[int], object]:
    if progress is True:
        from tqdm import tqdm

        bar = stack.enter_context(tqdm(total=total, unit="B", unit_scale=True, desc=desc))
        return bar.update
    return progress if callable(progress) else (lambda n: None)


def unpack(source: str, target: str, *, progress=False, max_frame_nbytes: int = MAX_FRAME_NBYTES,
           window_nbytes: int = DEFAULT_WINDOW_NBYTES, drop_pages: bool = True) -> UnpackReport:
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
        update = _progress(stack, progress, reader.nbytes, f"unpacking {os.path.basename(source)}")
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
    if reader.manifest is not None:
        if digest != reader.manifest.content_xxh3_128:
            raise IntegrityError(f"{reader.path}: the decompressed content's xxh3-128 is {digest.hex()}, the "
                                 f"manifest says {reader.manifest.content_xxh3_128.hex()}; nothing was published")
        checks.append("content xxh3-128")
    return tuple(checks)


@dataclass(frozen=True)
class ExtractReport:
    """One extracted range: ``what`` ("key 'w'" / "segment 3"), its content
    ``offset``/``nbytes``, frames decompressed out of the file's total."""

    source: str
    target: Optional[str]
    what: str
    offset: int
    nbytes: int
    frames_decoded: int
    frames_total: int

    def summary(self) -> str:
        return (f"extracted {self.what} ({self.nbytes:,} bytes at offset {self.offset:,}) from {self.source} -> "
                f"{self.target or 'stdout'}: decompressed {self.frames_decoded} of {self.frames_total} frames")


class PackedArtifact:
    """A packed .pte/.ptd, read without unpacking it.

    Calls: 1) the constructor opens the packed file and parses the section map
    (:class:`~ptdstream.reader.Artifact`) from the frames covering the metadata
    only; 2) :meth:`segment`, :meth:`read`, :meth:`extract`;
    3) :meth:`close` (or leave the ``with``). Memory: one frame plus the metadata.
    Not thread-safe.

    Raises:
        FormatError: the packed file, or the .pte/.ptd in it, is invalid.
        IntegrityError: a frame read fails its checks.
        MissingKeyError: an unknown key or segment index.
        OSError: the file cannot be read.
    """

    def __init__(self, path: str, *, max_frame_nbytes: int = MAX_FRAME_NBYTES) -> None:
        self.reader = SeekableReader(path, max_frame_nbytes=max_frame_nbytes, drop_pages=False)
        try:
            self.artifact: Artifact = parse_artifact(f"{self.reader.path} (decompressed)", self.reader.nbytes,
                                                     self.reader.read_at)
        except BaseException:
            self.reader.close()
            raise

    def segment(self, key: Optional[str] = None, index: Optional[int] = None) -> Segment:
        """The segment holding named-data ``key``, or segment number ``index``."""
        art = self.artifact
        if key is not None:
            found = art.keys.get(key)
            if found is None:
                names = ", ".join(repr(k) for k in list(art.keys)[:5]) or "none"
                raise MissingKeyError(f"{self.reader.path}: no key {key!r}; it has {len(art.keys)} keys "
                                      f"({names}{', ...' if len(art.keys) > 5 else ''}); list them with --list")
            return art.segments[found]
        if index is None or not 0 <= index < len(art.segments):
            raise MissingKeyError(f"{self.reader.path}: no segment {index}; it has {len(art.segments)} segments")
        return art.segments[index]

    def read(self, key: Optional[str] = None, index: Optional[int] = None) -> bytes:
        """The bytes of named-data ``key`` or of segment ``index`` (allocates their size)."""
        seg = self.segment(key, index)
        return self.reader.read_at(seg.start, seg.nbytes)

    def extract(self, target: Optional[str], key: Optional[str] = None, index: Optional[int] = None,
                stream=None) -> ExtractReport:
        """Stream the segment to the file ``target`` (published atomically) or, when
        None, to the binary ``stream`` (default stdout); one frame in memory at a time."""
        seg = self.segment(key, index)
        before = self.reader.frames_decoded
        with ChunkedFileSink(target) if target is not None else contextlib.nullcontext(stream or sys.stdout.buffer) as out:
            for piece in self.reader.iter_range(seg.start, seg.nbytes):
                out.write(piece)
        what = f"key {key!r}" if key is not None else f"segment {seg.index}"
        return ExtractReport(self.reader.path, target, what, seg.start, seg.nbytes,
                             self.reader.frames_decoded - before, sum(1 for f in self.reader.table.frames if f.nbytes))

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> "PackedArtifact":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------- command line
