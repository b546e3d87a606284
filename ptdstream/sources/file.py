"""File sources: a byte range of a file, read with ``pread`` into a reused ring."""

from __future__ import annotations

import os
from typing import Iterator, Optional

from ..errors import IntegrityError, LayoutError
from ..system.files import pread_exact
from ..system.pagecache import drop_pages
from .base import BufferRing, Source


class FileRangeSource(Source):
    """``length`` bytes of the file at ``path`` from byte ``offset``, read with pread.

    Pieces are read into the ring's buffers; the file's pages are dropped from
    the page cache after each piece (``POSIX_FADV_DONTNEED``), so a large source
    does not fill the cache.

    Raises:
        LayoutError: at construction, when the range lies beyond the file's end.
        IntegrityError: while reading, when the file has shrunk (names the file
            and the offset where data ran out).
    """

    def __init__(self, path: str, offset: int = 0, length: Optional[int] = None) -> None:
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

    def describe(self) -> str:
        return f"file {self.path} offset {self.offset}"

    def prefix(self, nbytes: int = 32) -> bytes:
        with open(self.path, "rb") as f:
            return os.pread(f.fileno(), min(nbytes, self.nbytes), self.offset)

    def pieces(self, ring: BufferRing) -> Iterator[memoryview]:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < self.nbytes:
                buf = ring.next()
                want = min(len(buf), self.nbytes - done)
                got = pread_exact(fd, buf[:want], self.offset + done)
                if got < want:
                    raise IntegrityError(
                        f"file {self.path}: ended at offset {self.offset + done + got}, "
                        f"expected {self.nbytes} bytes from offset {self.offset}"
                    )
                yield buf[:want]
                drop_pages(fd, self.offset + done, want)
                done += want
        finally:
            os.close(fd)
