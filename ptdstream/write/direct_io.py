"""O_DIRECT writes from page-aligned staging blocks, several in flight at once.

:class:`~ptdstream.write.sink.ChunkedFileSink` with ``direct=True`` gathers the bytes
it is given into ``DIRECT_BLOCK_NBYTES`` (8 MiB) anonymous-mmap blocks (page
aligned, as O_DIRECT needs) and hands each full block to one of ``depth`` I/O
threads, which ``pwrite`` it at its own offset (``os.pwrite`` releases the GIL).
So the staging copy of the next block overlaps the writes of the previous ones,
and the disk sees ``depth`` requests at once instead of one (one synchronous
write at a time leaves the disk idle between writes).

Host memory: ``(depth + 1) * block_nbytes`` bytes (32 MiB by default).
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import time
from collections.abc import Callable

from ..system.threads import FdThread
from ..timeline import stage_timeline

__all__ = ["DEFAULT_DIRECT_DEPTH", "DirectBlockWriter"]

#: O_DIRECT writes in flight (I/O threads).
DEFAULT_DIRECT_DEPTH = 3


class DirectBlockWriter:
    """Stage bytes into aligned blocks and write full blocks with ``depth`` threads.

    Args:
        fd: a file opened (or switched) to ``O_DIRECT``, written from offset 0.
        describe: names the file in errors (``"<temp path> (for <target>)"``).
        block_nbytes: staging block size (a multiple of the alignment).
        depth: I/O threads, i.e. writes in flight.
        alignment: O_DIRECT alignment of the padded last block.
        pwrite_fn: ``os.pwrite``-like function (tests inject short writes and faults).

    Raises (from ``write``, ``finish``): OSError naming the file and the offset of
    the first failed write; later blocks are not written.
    """

    def __init__(
        self,
        fd: int,
        describe: str,
        block_nbytes: int,
        depth: int = DEFAULT_DIRECT_DEPTH,
        alignment: int = 4096,
        pwrite_fn: Callable[[int, memoryview, int], int] = os.pwrite,
    ) -> None:
        if depth < 1 or block_nbytes % alignment:
            raise ValueError(f"depth {depth} < 1 or block {block_nbytes} not a multiple of {alignment}")
        self._fd = fd
        self._describe = describe
        self._block = block_nbytes
        self._alignment = alignment
        self._pwrite = pwrite_fn
        self._maps = [mmap.mmap(-1, block_nbytes) for _ in range(depth + 1)]
        self._free: queue.Queue[memoryview] = queue.Queue()
        for m in self._maps[1:]:
            self._free.put(memoryview(m))
        self._jobs: queue.Queue[tuple[memoryview, int, int] | None] = queue.Queue()
        self._error: OSError | None = None
        self._current = memoryview(self._maps[0])
        self._used = 0
        self.nbytes = 0  # bytes staged so far (the file's logical size)
        self._threads: list[FdThread] = [FdThread(self._serve, f"ptdstream-direct-{i}") for i in range(depth)]

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            block, length, offset = job
            try:
                if self._error is None:
                    t = time.perf_counter()
                    self._write_all(block[:length], offset)
                    timeline = stage_timeline()
                    if timeline is not None:
                        timeline.add("O_DIRECT pwrite (I/O threads)", time.perf_counter() - t, length)
            except OSError as e:
                if self._error is None:
                    self._error = e
            finally:
                self._free.put(block)
                self._jobs.task_done()

    def _write_all(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            try:
                n = self._pwrite(self._fd, view[done:], offset + done)
            except InterruptedError:
                continue
            except OSError as e:
                raise OSError(
                    e.errno,
                    f"writing {self._describe} at offset {offset + done}: {os.strerror(e.errno or 0)}",
                ) from e
            if n <= 0:
                raise OSError(
                    errno.EIO,
                    f"writing {self._describe} at offset {offset + done}: write returned {n} "
                    f"with {len(view) - done} bytes left",
                )
            done += n

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _submit(self, length: int) -> None:
        offset = self.nbytes - self._used
        self._jobs.put((self._current, length, offset))
        t = time.perf_counter()
        self._current = self._free.get()
        timeline = stage_timeline()
        if timeline is not None:
            timeline.add("wait for a free staging block", time.perf_counter() - t)
        self._used = 0
        self._raise_error()

    def write(self, view: memoryview) -> None:
        """Copy ``view`` into the staging blocks; full blocks go to the I/O threads."""
        self._raise_error()
        timeline = stage_timeline()
        done = 0
        while done < len(view):
            n = min(self._block - self._used, len(view) - done)
            t = time.perf_counter()
            self._current[self._used : self._used + n] = view[done : done + n]
            if timeline is not None:
                timeline.add("staging copy", time.perf_counter() - t, n)
            self._used += n
            self.nbytes += n
            done += n
            if self._used == self._block:
                self._submit(self._block)

    def finish(self) -> bool:
        """Write the last block (padded to the alignment) and wait for every write.

        Returns whether the file was padded (the caller truncates it to ``nbytes``).
        """
        self._raise_error()
        padded = False
        if self._used:
            length = self._used + (-self._used) % self._alignment
            self._current[self._used : length] = bytes(length - self._used)
            padded = length != self._used
            self._submit(length)
        self._jobs.join()
        self._raise_error()
        return padded

    def close(self) -> None:
        """Stop the I/O threads (after the writes queued) and unmap the blocks.
        Idempotent. Waits for the threads even through Ctrl-C (raised again once
        they have ended): the caller closes the file descriptor they write to."""
        if not self._threads:
            return
        for _ in self._threads:
            self._jobs.put(None)
        interrupted = None
        for t in self._threads:
            interrupted = t.wait() or interrupted
        self._threads = []
        self._current = None  # type: ignore[assignment]  # dropped so the maps can close; unused after close
        while not self._free.empty():
            self._free.get().release()
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass
        if interrupted is not None:
            raise interrupted
