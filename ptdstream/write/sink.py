"""``ChunkedFileSink``: a temp file beside the target, written in pieces, published atomically.

Calls, in order: 1) open (the constructor creates the temp file); 2) ``write`` /
``write_zeros`` any number of times; 3) ``sync`` (fsync the file, drop its pages);
4) ``publish`` (rename over the target, fsync the folder). ``commit`` does 3 and
4. ``abort`` removes the temp file and may be called in any state; it is
idempotent. Used as a context manager, an exception inside the ``with`` aborts
and a clean exit commits.

Page cache: the output goes to disk window by window and leaves the page cache
(:class:`ptdstream.system.writeback.WritebackWindows`), so a bounded number of
windows stay resident while writing (11 x 64 MiB by default), and none after
``sync``.

On any failure: the temp file is removed, the target is untouched (absent, or the
previous complete file). Temp files are named ``.<name>.ptdstream-<pid>-<hex>.tmp``
and locked (``flock``) by their writer until published or removed, so that
leftovers of a killed process, in any PID namespace, are recognisable
(:func:`ptdstream.write.tempfiles.stale_temp_files`).

Folder recovery (removing killed writers' leftovers and completing a set
publication a killed save left half done: :func:`ptdstream.write.folder.prepare_folder`, which runs
:func:`ptdstream.write.journal.clean_folder`) runs once per save and folder,
before the save's first temp file is created. A sink used on its own does it
itself (``clean_folder=True``, the default); a set-level writer runs it once
per folder (:func:`ptdstream.write.publish.prepare_folders`) and makes its
sinks with ``clean_folder=False``, so that they only create, write, sync and
abort their temp file.

A target that is a symlink is written through the link, as upstream's ``open``
does: the temp file is created beside the file the link points to and renamed
over that file (the link stays). An update keeps the target's permission bits.
Not thread-safe.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..defaults import CHUNK_NBYTES, WINDOW_NBYTES
from ..errors import StateError
from ..system import fsops
from ..system.pagecache import drop_pages
from ..system.writeback import WritebackWindows
from ..timeline import stage_timeline
from . import tempfiles
from .direct_io import DEFAULT_DIRECT_DEPTH, DirectBlockWriter
from .folder import prepare_folder, resolve_target
from .open_inputs import refuse_open_checkpoints
from .sink_protocol import SinkState, write_zeros

if TYPE_CHECKING:
    from types import TracebackType

    from _typeshed import ReadableBuffer

__all__ = ["ChunkedFileSink"]

#: O_DIRECT: bytes per write from the staging block, and the alignment of the
#: last (padded, then truncated) block.
DIRECT_BLOCK_NBYTES = CHUNK_NBYTES
DIRECT_ALIGNMENT = 4096


class ChunkedFileSink:
    """Write one file through a temp file, then publish it under ``target``.

    Args:
        target: the final path.
        window_nbytes: bytes between page-cache drops (64 MiB).
        drop_pages: drop written pages per window and after sync (default on).
        inflight_windows: windows under writeback before the oldest is waited for
            and dropped (None: ``system.writeback.DEFAULT_INFLIGHT_WINDOWS``, 8; at
            most ``(inflight_windows + 3) * window_nbytes`` of output cached while
            writing).
        direct: write with ``O_DIRECT`` through aligned 8 MiB staging blocks (one
            memcpy, no page cache at all), ``direct_depth`` writes in flight
            (:class:`~ptdstream.write.direct_io.DirectBlockWriter`); where the file
            system refuses O_DIRECT (tmpfs, some network file systems) the sink
            falls back to buffered writes and sets ``self.direct = False``.
        write_fn: ``os.write``-like function (tests inject short writes and faults).
        direct_depth: O_DIRECT writes in flight (I/O threads).
        pwrite_fn: ``os.pwrite``-like function for the O_DIRECT path.
        clean_folder: run the folder step (:func:`~ptdstream.write.folder.prepare_folder`) for the
            folder of the file renamed over before creating the temp file. Keep
            it on for a sink used on its own; a writer of several files runs
            :func:`ptdstream.write.publish.prepare_folders` once for all of
            them first and passes ``False``.

    Raises:
        IsADirectoryError: ``target`` is a folder (nothing is created).
        OSError: the folder is missing or not writable (nothing is created; the
            message names the target and its folder), or a write, fsync or
            rename failed (the temp file is removed first).
        StateError: a method called in the wrong state.
    """

    def __init__(
        self,
        target: str | os.PathLike[str],
        *,
        window_nbytes: int = WINDOW_NBYTES,
        drop_pages: bool = True,
        inflight_windows: int | None = None,
        direct: bool = False,
        write_fn: Callable[[int, memoryview], int] = os.write,
        direct_depth: int = DEFAULT_DIRECT_DEPTH,
        pwrite_fn: Callable[[int, memoryview, int], int] = os.pwrite,
        clean_folder: bool = True,
    ) -> None:
        self.target = os.path.abspath(os.fspath(target))
        #: the path renamed over: ``target``, or the file a symlink ``target`` names
        self.publish_path = resolve_target(self.target)
        self.window_nbytes = window_nbytes
        self.drop_pages = drop_pages
        self._write = write_fn
        self.nbytes = 0
        self._inflight_windows = inflight_windows
        self._writeback: WritebackWindows | None = None
        self._fd: int | None = None
        self._lock_fd: int | None = None
        folder = os.path.dirname(self.publish_path)
        refuse_open_checkpoints([self.target])
        if os.path.isdir(self.publish_path):
            # Found now, not at the rename after every byte was written (and after
            # the files published before this one were renamed).
            raise IsADirectoryError(
                errno.EISDIR,
                f"cannot write {self.target}: it is a folder; remove it or choose "
                "another path",
                self.target,
            )
        if clean_folder:
            prepare_folder(folder)
        self._staging: DirectBlockWriter | None = None
        self.temp_path, self._fd, self._lock_fd = tempfiles.create_locked(self.publish_path)
        self.state = SinkState.OPEN
        try:
            try:
                mode = os.stat(self.publish_path).st_mode & 0o7777
            except OSError:
                mode = None
            if mode is not None:
                os.fchmod(self._fd, mode)  # an update keeps the target's mode (0444 too)
            self.direct = bool(direct) and hasattr(os, "O_DIRECT")
            if self.direct:
                self._enable_direct(direct_depth, pwrite_fn)
            if self.drop_pages and not self.direct:
                self._writeback = WritebackWindows(self._fd, window_nbytes, self._inflight_windows)
        except BaseException:  # Ctrl-C included: no caller holds this sink to abort it
            self.abort()
            raise

    def _open_fd(self) -> int:
        """The temp file's descriptor: open from the constructor until :meth:`sync` or :meth:`abort`.

        Raises:
            StateError: it was closed (a method called after ``sync`` or ``abort``).
        """
        if self._fd is None:
            raise StateError(f"sink for {self.target}: its temp file {self.temp_path} is closed "
                             f"(state {self.state.value})")
        return self._fd

    def _enable_direct(self, depth: int, pwrite_fn: Callable[[int, memoryview, int], int]) -> None:
        """Switch the temp file to O_DIRECT with a page-aligned staging block; keep
        buffered writes (``self.direct = False``) where the file system refuses it."""
        import fcntl
        import mmap

        fd = self._open_fd()
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
            probe_map = mmap.mmap(-1, DIRECT_ALIGNMENT)
            try:
                os.pwrite(fd, memoryview(probe_map), 0)
                os.ftruncate(fd, 0)
            finally:
                probe_map.close()
        except OSError:
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags)
            except (OSError, UnboundLocalError):
                pass
            self.direct = False
            return
        self._staging = DirectBlockWriter(
            fd, f"{self.temp_path} (for {self.target})", DIRECT_BLOCK_NBYTES,
            depth=depth, alignment=DIRECT_ALIGNMENT, pwrite_fn=pwrite_fn,
        )

    def _release_staging(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.close()

    def _expect(self, *states: SinkState) -> None:
        if self.state not in states:
            names = " or ".join(s.value for s in states)
            raise StateError(
                f"sink for {self.target}: expected state {names}, but it is {self.state.value}"
            )

    def write(self, data: ReadableBuffer) -> None:
        """Append ``data`` (any bytes-like object); loops until every byte is written."""
        self._expect(SinkState.OPEN, SinkState.WRITING)
        self.state = SinkState.WRITING
        view = memoryview(data).cast("B")
        if self._staging is not None:
            self._staging.write(view)
            self.nbytes = self._staging.nbytes
            return
        timeline = stage_timeline()
        t = time.perf_counter() if timeline is not None else 0.0
        self._write_all(view, self.nbytes)
        if timeline is not None:
            timeline.add("buffered write", time.perf_counter() - t, len(view))
        if self._writeback is not None:
            self._writeback.written(self.nbytes, len(view))
        self.nbytes += len(view)

    def _write_all(self, view: memoryview, offset: int) -> None:
        total = len(view)
        done = 0
        fd = self._open_fd()
        while done < total:
            try:
                n = self._write(fd, view[done:])
            except InterruptedError:
                continue  # EINTR: nothing was written; retry, as io does (PEP 475)
            except OSError as e:
                raise OSError(
                    e.errno,
                    f"writing {self.temp_path} (for {self.target}) at offset "
                    f"{offset + done}: {os.strerror(e.errno or 0)}",
                ) from e
            if n <= 0:
                raise OSError(
                    errno.EIO,
                    f"writing {self.temp_path} at offset {offset + done}: "
                    f"write returned {n} with {total - done} bytes left",
                )
            done += n

    def write_zeros(self, nbytes: int) -> None:
        """Append ``nbytes`` zero bytes."""
        write_zeros(self.write, nbytes)

    def sync(self) -> None:
        """fsync the temp file and drop its pages; the data is durable but not yet visible."""
        self._expect(SinkState.OPEN, SinkState.WRITING)
        fd = self._open_fd()
        timeline = stage_timeline()
        t = time.perf_counter()
        self._stop_writeback()
        if self._staging is not None:
            try:
                if self._staging.finish():
                    os.ftruncate(fd, self.nbytes)
            finally:
                self._release_staging()
            if timeline is not None:
                timeline.add("O_DIRECT drain (last writes)", time.perf_counter() - t)
                t = time.perf_counter()
        try:
            fsops.fsync(fd, self.temp_path)
        except OSError as e:
            raise OSError(
                e.errno,
                f"fsync of {self.temp_path} (for {self.target}) failed: "
                f"{os.strerror(e.errno or 0)}",
            ) from e
        if self.drop_pages:
            drop_pages(fd, 0, 0)
        if timeline is not None:
            timeline.add("fsync + drop", time.perf_counter() - t)
        os.close(fd)
        self._fd = None
        self.state = SinkState.SYNCED

    def _stop_writeback(self) -> None:
        writeback, self._writeback = self._writeback, None
        if writeback is not None:
            writeback.close()

    def publish(self) -> None:
        """Rename the temp file over the target and fsync the folder."""
        self._expect(SinkState.SYNCED)
        fsops.replace(self.temp_path, self.publish_path)
        self.state = SinkState.COMMITTED
        self._release_lock()
        fsops.fsync_dir(os.path.dirname(self.publish_path))

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def commit(self) -> None:
        """``sync`` then ``publish``."""
        self.sync()
        self.publish()

    def abort(self) -> None:
        """Close and remove the temp file; the target is untouched. Idempotent."""
        if self.state in (SinkState.COMMITTED, SinkState.ABORTED):
            return
        interrupted = None
        # The threads that write to or advise on the fd end first (even when Ctrl-C
        # comes): closed under them, its number could be reused by another file.
        for stop in (self._stop_writeback, self._release_staging):
            try:
                stop()
            except KeyboardInterrupt as e:
                interrupted = e
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        fsops.unlink(self.temp_path)
        self._release_lock()
        self.state = SinkState.ABORTED
        if interrupted is not None:
            raise interrupted

    def __enter__(self) -> ChunkedFileSink:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            if self.state in (SinkState.OPEN, SinkState.WRITING):
                self.sync()
            if self.state is SinkState.SYNCED:
                self.publish()
        except BaseException:
            self.abort()
            raise
