"""The page cache: dropping a file's pages, paging out file-mapped memory (or
unmapping it with the page cache kept), and measuring how much of a file is resident."""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import NamedTuple

from .files import open_input_fd

__all__ = [
    "FOLIO_NBYTES",
    "READAHEAD_NBYTES",
    "FileMapping",
    "drop_pages",
    "drop_read",
    "file_mapping",
    "page_out",
    "private_copies",
    "release_mapped",
    "release_shared_under",
    "resident_nbytes",
    "will_need",
]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PAGE_NBYTES = mmap.PAGESIZE
#: The largest page-cache folio mapped by one PMD on x86-64/arm64 (4 KiB pages):
#: after large reads and writes the kernel caches a file in folios up to this
#: size, and ``POSIX_FADV_DONTNEED`` drops only the folios a range covers whole.
FOLIO_NBYTES = 2 << 20
#: Bytes past a sequential read that the kernel may have read ahead (128 KiB by
#: default, a few MiB at most).
READAHEAD_NBYTES = 8 << 20
_MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21)  # Linux >= 5.4
_MADV_DONTNEED = mmap.MADV_DONTNEED
#: ``/proc/self/pagemap`` entry bits (``Documentation/admin-guide/mm/pagemap.rst``)
_PM_PRESENT = 1 << 63
_PM_SWAPPED = 1 << 62
_PM_FILE = 1 << 61  # a file page or shared anonymous: not a private copy-on-write page


def resident_nbytes(path: str) -> int:
    """Bytes of ``path`` resident in the page cache now (Linux ``mincore``).

    Maps the file without touching it, so the measurement does not load pages.

    Raises:
        OSError: the file cannot be opened or mapped.
    """
    size = os.path.getsize(path)
    if size == 0:
        return 0
    fd = open_input_fd(path)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {path} failed: {os.strerror(err)}")
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore of {path} failed: {os.strerror(err)}")
            return sum(v & 1 for v in vec) * mmap.PAGESIZE
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_pages(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to drop ``[offset, offset + nbytes)`` of ``fd`` from the page
    cache (``POSIX_FADV_DONTNEED``; ``nbytes == 0`` means to the end). Clean pages
    go at once; dirty ones only after writeback. Errors are ignored: it is advice."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def drop_read(fd: int, offset: int, nbytes: int, last: bool = False) -> None:
    """Drop the pages of a sequential read just made, ``[offset, offset + nbytes)``
    of ``fd``, reaching back to the :data:`FOLIO_NBYTES` block it starts in (a
    folio that straddles the previous piece's end is whole only now); ``last``:
    the read's final piece, so also the folio that holds its end and what was
    read ahead past it (:data:`READAHEAD_NBYTES`). Pages before ``offset`` in
    that block are dropped too: clean pages cost only a second read.
    Errors are ignored: it is advice."""
    first = offset - offset % FOLIO_NBYTES
    end = offset + nbytes + (READAHEAD_NBYTES if last else 0)
    drop_pages(fd, first, end - first)


class FileMapping(NamedTuple):
    """One file-backed mapping of this process (a line of ``/proc/self/maps``):
    its address range, the file's path, the file offset at ``start`` and the
    file's inode."""

    start: int
    stop: int
    path: str
    offset: int
    inode: int


def file_mapping(address: int, nbytes: int) -> FileMapping | None:
    """The file-backed mapping of this process that holds ``[address, address +
    nbytes)`` whole (a mapping with an inode), such as the storages of
    ``torch.load(mmap=True)`` or safetensors; None when there is none or
    ``/proc`` cannot be read."""
    end = address + nbytes
    try:
        with open("/proc/self/maps", "rb") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                start_s, _, stop_s = fields[0].partition(b"-")
                start, stop = int(start_s, 16), int(stop_s, 16)
                if start <= address < stop:
                    if end > stop or len(fields) < 6 or fields[4] == b"0":
                        return None
                    path = os.fsdecode(fields[5].rstrip(b"\n"))
                    return FileMapping(start, stop, path, int(fields[2], 16), int(fields[4]))
    except OSError:
        pass
    return None


def will_need(address: int, nbytes: int, bounds: tuple[int, int]) -> None:
    """Start reading ``[address, address + nbytes)`` of a file mapping ahead of
    use (``MADV_WILLNEED``: asynchronous read-ahead into the page cache; nothing
    is mapped in). Clipped to ``bounds``; errors are ignored."""
    start = max(bounds[0], address - address % _PAGE_NBYTES)
    end = min(bounds[1], address + nbytes)
    if end > start:
        _libc.madvise(start, end - start, mmap.MADV_WILLNEED)


def page_out(address: int, nbytes: int, bounds: tuple[int, int]) -> None:
    """Ask the kernel to reclaim the pages of ``[address, address + nbytes)`` from
    this process now (``MADV_PAGEOUT``).

    Meant for file-backed memory: clean pages are dropped and read back from the
    file on the next access, so the contents never change. The range is widened
    to whole 2 MiB blocks, clipped to ``bounds`` (the mapping, from
    :func:`file_mapping`), because the kernel keeps a large folio that the range
    covers only in part. Errors are ignored (it is advice; kernels before 5.4
    refuse it)."""
    if nbytes <= 0:
        return
    start = max(bounds[0], address - address % FOLIO_NBYTES)
    end = address + nbytes
    end = min(bounds[1], end + (-end) % FOLIO_NBYTES)
    start -= start % _PAGE_NBYTES
    _libc.madvise(start, end - start, _MADV_PAGEOUT)


def private_copies(address: int, nbytes: int) -> bool | None:
    """Whether a page of ``[address, address + nbytes)`` is a private copy made by
    a write to a ``MAP_PRIVATE`` mapping (present or swapped, and not a file
    page, per ``/proc/self/pagemap``): where none is, the memory shows the
    mapped file's bytes. None when ``pagemap`` cannot be read. Reads 8 bytes
    per page of the range."""
    start = address - address % _PAGE_NBYTES
    end = address + nbytes
    end += (-end) % _PAGE_NBYTES
    pages = (end - start) // _PAGE_NBYTES
    if pages <= 0:
        return False
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, 8 * pages, 8 * (start // _PAGE_NBYTES))
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) != 8 * pages:
        return None
    entries = memoryview(raw).cast("Q")
    return any(e & (_PM_PRESENT | _PM_SWAPPED) and not e & _PM_FILE for e in entries)


def release_mapped(address: int, nbytes: int, bounds: tuple[int, int]) -> bool:
    """Hand the pages of ``[address, address + nbytes)`` of a file mapping back
    (out of this process's RSS) while keeping them in the page cache, for bytes
    that will be read again soon (a hash before the save).

    ``MADV_DONTNEED`` only unmaps a file page (the page cache keeps it; the next
    access maps it again from memory), but it would discard a private page
    made by a write to a ``MAP_PRIVATE`` mapping: so it is used only when no
    page of the range is such a copy (``/proc/self/pagemap``), else the range
    goes through :func:`page_out`, as when ``pagemap`` cannot be read. The
    range is widened to whole pages, clipped to ``bounds``. Returns whether
    the pages were released with the page cache kept. Errors are ignored (it
    is advice)."""
    if nbytes <= 0:
        return False
    start = max(bounds[0], address - address % _PAGE_NBYTES)
    end = address + nbytes
    end = min(bounds[1], end + (-end) % _PAGE_NBYTES)
    if end <= start or private_copies(start, end - start) is not False:
        page_out(address, nbytes, bounds)
        return False
    return bool(_libc.madvise(start, end - start, _MADV_DONTNEED) == 0)


def release_shared_under(folder: str) -> int:
    """Unmap from this process the pages of every shared file mapping (``rw-s``
    in ``/proc/self/maps``; ``torch.UntypedStorage.from_file(shared=True)``) of
    a file in ``folder`` (its real path; removed and nameless files included),
    the page cache keeping them (``MADV_DONTNEED``). A shared mapping has no
    private copies, so nothing is lost (a write is in the file already) and the
    next access maps the page again from the cache; private mappings are left
    alone. No page is read. Returns the bytes of the mappings advised (0 when
    ``/proc`` cannot be read); errors are ignored (it is advice)."""
    prefix = os.fsencode(os.path.join(os.path.realpath(folder), ""))
    advised = 0
    try:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[1][3:4] != b"s" or not fields[5].startswith(prefix):
            continue
        start_s, _, stop_s = fields[0].partition(b"-")
        start, stop = int(start_s, 16), int(stop_s, 16)
        if _libc.madvise(start, stop - start, _MADV_DONTNEED) == 0:
            advised += stop - start
    return advised
