"""Bounded writeback: a file's written pages go to disk window by window and leave
the page cache, so writing N bytes keeps only a few windows cached.

Every ``window_nbytes`` written, a background thread starts writeback of that
window (``sync_file_range(SYNC_FILE_RANGE_WRITE)``); once more than ``inflight``
windows are under writeback, it waits for the oldest and drops it
(``POSIX_FADV_DONTNEED``). About ``(inflight + 3) * window_nbytes`` of the file
are cached while writing (11 x 64 MiB by default; :class:`WritebackWindows`
gives the exact bound).

Why a thread: ``SYNC_FILE_RANGE_WRITE`` blocks while the disk's queue is full.
Called from the writer, it would put the writer's copies into the page cache and
the disk's work end to end instead of side by side, whatever the depth.

Used by :class:`ptdstream.write.sink.ChunkedFileSink` (one writer, front to back)
and by :mod:`ptdstream.distributed.protocol` (each rank's ``pwrite`` ranges in one
shared file). Without ``sync_file_range`` (not Linux) it does nothing: the final
fsync writes, and the caller drops the pages after it.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import queue
import threading
import time
from collections.abc import Callable

from ..defaults import WINDOW_NBYTES
from ..timeline import stage_timeline
from .pagecache import drop_read
from .threads import FdThread

__all__ = ["DEFAULT_INFLIGHT_WINDOWS", "WritebackWindows"]

#: Windows under writeback at once (see the module docstring).
DEFAULT_INFLIGHT_WINDOWS = 8

_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_AFTER = 4


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


class WritebackWindows:
    """Send ``fd``'s written ranges to disk window by window from a background
    thread, and drop each window from the page cache once it is on disk.

    Args:
        fd: an open, writable file descriptor (not owned: never closed here; call
            :meth:`close` before closing it).
        window_nbytes: bytes per window (64 MiB).
        inflight: windows under writeback before the oldest is waited for
            (None: :data:`DEFAULT_INFLIGHT_WINDOWS`, read when constructed).

    Call :meth:`written` after each write with its offset and size. Writes need
    not be contiguous: a write that does not continue the current window closes
    it. Closed windows go to a thread (started with the first one) that starts
    their writeback (``SYNC_FILE_RANGE_WRITE``, which blocks while the disk's
    queue is full) and, once more than ``inflight`` are under writeback, waits
    for the oldest and drops it; so the writer's copies into the page cache
    overlap the submissions, as with the kernel's own flusher threads. A write
    larger than a window is sent as several. The writer waits only when
    ``inflight + 2`` sent windows are not yet dropped: at most ``(inflight + 3)
    * window_nbytes + 2 MiB`` of the file (a window's drop reaches back to the
    2 MiB block it starts in: the kernel drops only whole page-cache folios,
    which a large write makes up to 2 MiB) plus the write just made are cached
    while writing; ``inflight`` is at least 1. :meth:`close`
    stops the thread; windows still under writeback are left to the caller's
    fsync. Errors of ``sync_file_range`` are ignored (it is
    advice; the caller's fsync reports real write errors).
    """

    def __init__(self, fd: int, window_nbytes: int = WINDOW_NBYTES, inflight: int | None = None) -> None:
        self._fd = fd
        self.window_nbytes = window_nbytes
        self.inflight = max(1, DEFAULT_INFLIGHT_WINDOWS if inflight is None else inflight)
        self._start = self._end = 0
        self._slots = threading.Semaphore(self.inflight + 2)
        self._windows: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._thread: FdThread | None = None

    def written(self, offset: int, nbytes: int) -> None:
        """Record that ``[offset, offset + nbytes)`` was written."""
        if nbytes <= 0:
            return
        if offset != self._end:
            self._send(self._start, self._end)
            self._start = offset
        self._end = offset + nbytes
        while self._end - self._start >= self.window_nbytes:  # a large write: several windows
            self._send(self._start, self._start + self.window_nbytes)
            self._start += self.window_nbytes

    def flush(self) -> None:
        """Send the current, partial window now (before a pause in writing: its
        pages then leave the page cache with the windows that follow, or stay
        clean and reclaimable, instead of dirty until the next write)."""
        self._send(self._start, self._end)
        self._start = self._end

    def close(self) -> None:
        """Stop the thread (idempotent), waiting for it even through Ctrl-C (the
        interrupt is raised again once it has ended): the caller closes ``fd``
        next. The last, partial window is not sent: the caller's fsync writes it,
        and its drop after the fsync removes every page."""
        if self._thread is not None:
            self._windows.put(None)
            interrupted = self._thread.wait()
            self._thread = None
            if interrupted is not None:
                raise interrupted

    def _send(self, start: int, end: int) -> None:
        if end <= start or _sync_file_range is None:
            return
        timeline = stage_timeline()
        t = time.perf_counter() if timeline is not None else 0.0
        self._slots.acquire()
        if timeline is not None:
            timeline.add("writeback: writer waits for a window slot", time.perf_counter() - t)
        if self._thread is None:
            self._thread = FdThread(self._serve, "ptdstream-writeback")
        self._windows.put((start, end))

    def _serve(self) -> None:
        sync_file_range = _sync_file_range
        if sync_file_range is None:  # submit() starts this thread only when it is there
            return
        under_writeback: collections.deque[tuple[int, int]] = collections.deque()
        while True:
            window = self._windows.get()
            if window is None:
                return
            timeline = stage_timeline()
            t = time.perf_counter() if timeline is not None else 0.0
            start, end = window
            sync_file_range(self._fd, start, end - start, _SYNC_FILE_RANGE_WRITE)
            under_writeback.append(window)
            while len(under_writeback) > self.inflight:
                old_start, old_end = under_writeback.popleft()
                sync_file_range(
                    self._fd,
                    old_start,
                    old_end - old_start,
                    _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER,
                )
                # drop_read reaches back to the 2 MiB block that holds old_start
                # (fadvise drops only whole folios, up to 2 MiB after a large
                # write); that block's start belongs to windows before, written
                # and waited for already (so clean now). A folio that holds
                # old_end goes with a later window.
                drop_read(self._fd, old_start, old_end - old_start)
                self._slots.release()
            if timeline is not None:
                timeline.add("writeback thread: start + wait + drop", time.perf_counter() - t)
