"""File sources: a byte range of a file, read with ``pread`` into a reused ring."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from ..errors import IntegrityError, LayoutError
from ..system.files import open_input, open_input_fd, pread_exact
from ..system.pagecache import READAHEAD_NBYTES, drop_pages, drop_read
from .base import NO_EXPECTATION, BufferRing, Expectation, FileIdentity, Source

__all__ = ["FileRangeSource", "pread_pieces"]


class FileRangeSource(Source):
    """``length`` bytes of the file at ``path`` from byte ``offset``, read with pread.

    Pieces are read into the ring's buffers; the file's pages are dropped from
    the page cache after each piece (:func:`~ptdstream.system.pagecache.drop_read`),
    so a large source leaves at most a few MiB of the file cached.

    Raises:
        LayoutError: at construction, when the range lies beyond the file's end.
        IntegrityError: while reading, when the file has shrunk (names the file
            and the offset where data ran out), or when it is not the file handed
            over: replaced (another device or inode) before it was opened, or
            changed (size, modification or change time) by the time its last byte
            was read. A file rewritten in place mid-save is refused, not torn; a
            second read of the file, which would double the disk traffic, is not
            needed. With ``expectation.file`` (the file's identity when it was
            opened: a checkpoint's), the file must still have that identity
            before the read as well as after it.
    """

    def __init__(self, path: str, offset: int = 0, length: int | None = None,
                 expectation: Expectation = NO_EXPECTATION) -> None:
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise LayoutError(
                f"file {self.path}: range offset {offset} + length {length} lies beyond "
                f"its size {size} bytes"
            )
        self.offset = offset
        self.nbytes = length
        self._expectation = expectation
        #: the file when handed over (``expectation.file``, else now)
        self.identity = expectation.file or FileIdentity.of(os.stat(self.path))

    def _check_identity(self, fd: int, when: str, fields: int = len(FileIdentity._fields)) -> None:
        now = FileIdentity.of(os.fstat(fd))
        if now[:fields] != self.identity[:fields]:
            what = "replaced" if now[:2] != self.identity[:2] else "changed"
            raise IntegrityError(
                f"file {self.path}: {what} {when} (device, inode, size, modification and "
                f"change time {tuple(self.identity)} when handed over, {tuple(now)} now); a "
                "file must not be written to while it is saved"
            )

    #: Checked by its identity and change time when read, not digested at hand-over.
    is_mutable = False

    def describe(self) -> str:
        return f"file {self.path} offset {self.offset}"

    def prefix(self, nbytes: int = 32) -> bytes:
        """The first ``nbytes`` bytes; the pages read (and read ahead, up to
        :data:`~ptdstream.system.pagecache.READAHEAD_NBYTES`) are dropped again."""
        with open_input(self.path) as f:
            head = os.pread(f.fileno(), min(nbytes, self.nbytes), self.offset)
            drop_pages(f.fileno(), self.offset, min(self.nbytes, READAHEAD_NBYTES))
            return head

    def pieces(self, ring: BufferRing, keep_cache: bool = False) -> Iterator[memoryview]:
        """``keep_cache``: leave the pages read in the page cache (bytes read again soon)."""
        fd = open_input_fd(self.path)
        try:
            # taken at hand-over by someone else: it must not have changed since either
            self._check_identity(fd, "before it was read",
                                 fields=len(FileIdentity._fields) if self.expectation.file else 2)
            yield from pread_pieces(fd, self.offset, self.nbytes, ring, lambda end: IntegrityError(
                f"file {self.path}: ended at offset {end}, "
                f"expected {self.nbytes} bytes from offset {self.offset}"
            ), keep_cache)
            self._check_identity(fd, "while it was read")
        finally:
            os.close(fd)


def pread_pieces(fd: int, offset: int, nbytes: int, ring: BufferRing,
                 ended: Callable[[int], Exception], keep_cache: bool = False) -> Iterator[memoryview]:
    """``nbytes`` bytes of ``fd`` from ``offset``, read with pread into the ring's
    buffers and yielded piece by piece; each piece's pages are dropped once the
    next one is asked for (:func:`~ptdstream.system.pagecache.drop_read`), unless ``keep_cache``.

    Raises:
        Exception: ``ended(offset where the file ended)`` when it ends early.
    """
    done = 0
    while done < nbytes:
        buf = ring.next()
        want = min(len(buf), nbytes - done)
        got = pread_exact(fd, buf[:want], offset + done)
        if got < want:
            raise ended(offset + done + got)
        yield buf[:want]
        if not keep_cache:
            drop_read(fd, offset + done, want, last=done + want == nbytes)
        done += want

