"""Spill files: bytes that cannot stay where they are until the save, parked on disk.

executorch 1.5.1's CUDA backend frees each AOTI weight storage once its collector
has written it (``backends/cuda/cuda_weight_collector.py``). A storage that no
parameter of the process matches must be kept somewhere until ``ptdstream.save``
runs; :func:`ptdstream.hooks.cuda.backend.stream_cuda_weights` keeps it on the
device up to a budget and spills the rest here.

A :class:`SpillFile` is one unlinked temp file (``O_TMPFILE`` where the file
system has it, else a created and at once removed file): it has no name, and
it vanishes with the last :class:`SpilledSource` that reads it, or when the
process ends, even after a crash. Each :meth:`SpillFile.append` streams a
source into it (through the source's own pieces: a CUDA tensor goes through
the pinned ring), with bounded writeback
(:class:`~ptdstream.system.writeback.WritebackWindows`), and digests the bytes
(xxh3-128) on the way; the :class:`SpilledSource` it returns reads them back
with ``pread`` at the save, dropping pages as it goes, and the writer refuses
bytes that no longer match that digest (``expectation.fingerprint``).

Limits: where the file system has no ``O_TMPFILE``, a kill between creating
and removing the name leaves an empty ``.ptdstream-spill-*`` file, and on NFS
the open, removed file shows as ``.nfs*`` until it is closed. Processes of
the same user can still open it through ``/proc/PID/fd`` (a change is refused
at the save). On a tmpfs the spilled bytes stay in memory: give a folder on
disk.
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
import weakref
from collections.abc import Iterator

from ...defaults import WINDOW_NBYTES
from ...errors import IntegrityError
from ...sources.base import NO_EXPECTATION, BufferRing, Expectation, Source
from ...sources.file import pread_pieces
from ...sources.fingerprint import Fingerprint, StreamingDigest
from ...system.files import pwrite_all
from ...system.pagecache import drop_pages
from ...system.writeback import WritebackWindows

__all__ = ["SPILL_ALIGNMENT", "SpillFile", "SpilledSource"]

#: Each spilled range starts on this boundary (bytes): whole pages, so that
#: dropping one range's pages never touches its neighbour's.
SPILL_ALIGNMENT = 4096


def _open_unlinked(folder: str) -> int:
    """A read-write descriptor of a new, nameless file in ``folder``.

    Raises:
        OSError: ``folder`` is missing, not a folder or not writable (the
            message names it as the spill folder).
    """
    try:
        flag = getattr(os, "O_TMPFILE", 0)
        if flag:
            try:
                return os.open(folder, flag | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), 0o600)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EROFS):
                    raise
                # a file system without O_TMPFILE: a named file, removed at once
        fd, path = tempfile.mkstemp(prefix=".ptdstream-spill-", dir=folder)
    except OSError as e:
        raise OSError(e.errno, f"spill folder {folder}: cannot create a spill file there: "
                               f"{e.strerror}") from e
    try:
        os.unlink(path)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SpillFile:
    """An unlinked temp file in ``folder`` that sources are appended to.

    Args:
        folder: where the file lives (its file system takes the bytes).
        window_nbytes: bytes per writeback window (64 MiB): at most a few
            windows of it stay in the page cache while appending, and only the
            last few, written back, once an append returns.

    The descriptor is closed when the spill file and every :class:`SpilledSource`
    made from it are gone (or by :meth:`close`). One thread at a time may append.

    Raises:
        OSError: ``folder`` cannot hold a new file (missing, read-only, ...).
    """

    def __init__(self, folder: str, window_nbytes: int = WINDOW_NBYTES) -> None:
        self.folder = os.fspath(folder)
        self._fd = _open_unlinked(self.folder)
        self._closer = weakref.finalize(self, os.close, self._fd)
        self.window_nbytes = window_nbytes
        self._lock = threading.Lock()
        #: bytes of the file so far (the end of the last range, before alignment)
        self.nbytes = 0

    def append(self, source: Source, label: str, chunk_nbytes: int = 8 << 20,
               gpu_fingerprint: Fingerprint | None = None) -> SpilledSource:
        """Copy ``source``'s bytes to the end of the file (page-aligned).

        Args:
            source: what to spill; its pieces are read once, in order.
            label: what the bytes are, for error messages ("CUDA weight storage ...").
            chunk_nbytes: piece size (bytes) for sources read through a ring.
            gpu_fingerprint: the GPU fingerprint of the bytes where they came
                from, if the caller matches them by it (kept, not checked).

        Returns:
            A :class:`SpilledSource` over the range whose expectation holds the
            xxh3-128 digest of the bytes as spilled (``fingerprint``) and
            ``gpu_fingerprint``.

        Raises:
            OSError: the write failed (ENOSPC, EFBIG: names the folder and the
                offset of the failed write); the range is abandoned and the file
                stays usable for what was spilled before. An error of the source
                itself (reading its file) passes through unchanged.
            IntegrityError: ``source`` gave a different number of bytes than it
                said (refused as soon as it gives more), or the file was closed.
        """
        with self._lock:
            fd = self.fileno()  # refuses a closed spill file
            offset = -(-self.nbytes // SPILL_ALIGNMENT) * SPILL_ALIGNMENT
            digest = StreamingDigest()
            done = 0
            writeback = WritebackWindows(fd, self.window_nbytes)
            try:
                for piece in source.pieces(BufferRing(chunk_nbytes, count=2)):
                    view = memoryview(piece).cast("B")
                    if done + len(view) > source.nbytes:
                        raise IntegrityError(f"{label}: {source.describe()} gave more than the "
                                             f"{source.nbytes} bytes it said, when spilled to {self.folder}")
                    try:
                        pwrite_all(fd, view, offset + done)
                    except OSError as e:
                        at = getattr(e, "offset", offset + done)
                        raise OSError(e.errno, f"{label}: spilling {source.nbytes} bytes to an unlinked "
                                               f"temp file in {self.folder} at offset {at} failed: "
                                               f"{e.strerror}") from e
                    digest.update(view)
                    writeback.written(offset + done, len(view))
                    done += len(view)
                writeback.flush()
                writeback.close()
                # The last windows are still under writeback: wait for them, so
                # that the drop below leaves none of the range in the page cache.
                os.fdatasync(fd)
            finally:
                writeback.close()  # no thread outlives the call (nor touches a closed fd)
                drop_pages(fd, offset, done)  # what is on disk now; the rest starts writeback
            if done != source.nbytes:
                raise IntegrityError(f"{label}: {source.describe()} gave {done} bytes, not {source.nbytes}, "
                                     f"when spilled to {self.folder}")
            self.nbytes = offset + done
            return SpilledSource(self, offset, done, label,
                                 Expectation(fingerprint=digest.finish(), gpu_fingerprint=gpu_fingerprint))

    def fileno(self) -> int:
        """The descriptor (open while this object or a source of it lives).

        Raises:
            IntegrityError: the file was closed with :meth:`close` (its number
                may belong to another file by now).
        """
        if not self._closer.alive:
            raise IntegrityError(f"spill file in {self.folder}: closed; the bytes spilled to it are gone")
        return self._fd

    def close(self) -> None:
        """Close the file now (idempotent); its sources can no longer be read
        (they raise ``IntegrityError``)."""
        self._closer()


class SpilledSource(Source):
    """``nbytes`` bytes at ``offset`` of a :class:`SpillFile`, read with ``pread``.

    Made by :meth:`SpillFile.append`; keeps the spill file open while it lives.
    ``expectation``: the digest of the bytes as spilled (``fingerprint``) and,
    optionally, the GPU fingerprint of the bytes where they came from (a CUDA
    storage's), for callers that matched them by it (``gpu_fingerprint``).

    Raises:
        IntegrityError: while reading, when the file ends early or was closed
            (bytes changed through ``/proc/PID/fd`` are refused by the writer,
            against ``expectation.fingerprint``).
    """

    def __init__(self, spill: SpillFile, offset: int, nbytes: int, label: str,
                 expectation: Expectation = NO_EXPECTATION) -> None:
        self.spill = spill
        self.offset = offset
        self.nbytes = nbytes
        self.label = label
        self._expectation = expectation

    def describe(self) -> str:
        return f"{self.label}, spilled to an unlinked temp file in {self.spill.folder} at offset {self.offset}"

    def prefix(self, nbytes: int = 32) -> bytes:
        return os.pread(self.spill.fileno(), min(nbytes, self.nbytes), self.offset)

    def pieces(self, ring: BufferRing) -> Iterator[memoryview]:
        return pread_pieces(self.spill.fileno(), self.offset, self.nbytes, ring, lambda end: IntegrityError(
            f"{self.describe()}: the spill file ended at offset {end}, {self.nbytes} bytes expected"))

    def gpu_fingerprint(self) -> Fingerprint | None:
        """The fingerprint the bytes had where they came from (``expectation.gpu_fingerprint``)."""
        return self._expectation.gpu_fingerprint
