"""Sources over file-mapped memory: a checkpoint loaded with ``mmap`` read without
keeping it resident."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from ..errors import IntegrityError, LayoutError
from ..system.pagecache import FileMapping, page_out, private_copies, release_mapped, will_need
from .base import NO_EXPECTATION, BufferRing, Expectation, FileIdentity
from .file import FileRangeSource
from .tensor import TensorSource

if TYPE_CHECKING:
    import torch

__all__ = ["MappedTensorSource", "changed_in_place", "expected_files", "expecting_files", "opened_identity",
           "same_inode_now"]

_lock = threading.Lock()
#: (real path, inode) -> the identities :func:`expecting_files` registered for that file, latest last
_expected: dict[tuple[str, int], list[FileIdentity]] = {}


@contextlib.contextmanager
def expecting_files(identities: Iterable[tuple[str, FileIdentity | None]]) -> Iterator[None]:
    """Until exit, a mapping of one of these files (``(path, identity when it was
    opened)``; None: skipped) that :func:`opened_identity` is asked about expects that
    identity, whatever thread asks: ``weights_from`` registers its checkpoint's files
    so that the emitter's references to bound tensors (``hooks.emitter.reference``)
    check the file at every read of the save. Nests (the innermost registration wins)."""
    keys = [((os.path.realpath(path), ident.inode), ident) for path, ident in identities if ident is not None]
    with _lock:
        for key, ident in keys:
            _expected.setdefault(key, []).append(ident)
    try:
        yield
    finally:
        with _lock:
            for key, ident in keys:
                held = _expected[key]
                held.remove(ident)
                if not held:
                    del _expected[key]


def opened_identity(mapping: FileMapping) -> FileIdentity | None:
    """The identity :func:`expecting_files` registered for ``mapping``'s file (its
    path and inode), or None."""
    with _lock:
        held = _expected.get((mapping.path, mapping.inode))
        return held[-1] if held else None


def expected_files() -> dict[tuple[int, int], str]:
    """The files :func:`expecting_files` holds registered now (a ``weights_from``
    checkpoint's): ``(device, inode)`` -> the real path it was opened by. Files no
    writer may replace or remove (:mod:`ptdstream.write.open_inputs`)."""
    with _lock:
        return {(held[-1].device, inode): path for (path, inode), held in _expected.items()}


def changed_in_place() -> list[tuple[str, FileIdentity, FileIdentity]]:
    """The files :func:`expecting_files` holds registered whose path still names the
    inode registered but whose identity differs (written to in place since it was
    opened: what :class:`MappedTensorSource` refuses at a read): ``(real path,
    identity then, identity now)``. A file replaced (another inode) or removed is not
    listed: its mappings keep the old inode's bytes."""
    with _lock:
        held = [(path, inode, idents[-1]) for (path, inode), idents in _expected.items()]
    changed = []
    for path, inode, then in held:
        now = same_inode_now(path, inode)
        if now is not None and now != then:
            changed.append((path, then, now))
    return changed


def same_inode_now(path: str, inode: int) -> FileIdentity | None:
    """The identity of the file at ``path`` now, or None where that is no longer
    ``inode`` (removed, or replaced by a rename: a mapping keeps the old inode's bytes)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return FileIdentity.of(st) if st.st_ino == inode else None


class MappedTensorSource(TensorSource):
    """A :class:`~ptdstream.sources.TensorSource` over file-mapped memory (a
    checkpoint loaded with ``mmap``).

    Each piece is copied into the ring and its pages are paged out of this
    process at once (through the mapping) (read-ahead keeps two pieces ahead), so reading a whole
    checkpoint leaves about one piece resident. Before reading, the file is
    checked to be the one mapped and still long enough: a checkpoint shrunk
    under a mapping would otherwise kill the process with SIGBUS (a file
    replaced by rename is fine: the mapping keeps the old one).

    With ``read_file=True`` (a mapping only ptdstream holds, so its memory is the
    file's bytes: the checkpoints of :mod:`ptdstream.sources.checkpoint`), or
    with ``read_file=None`` (the default) where no page of the tensor's range is
    a private copy made by a write (``/proc/self/pagemap``: the memory shows the
    file's bytes), the pieces are read from the file with ``pread`` instead
    (:class:`~ptdstream.sources.file.FileRangeSource`: nothing mapped in, the
    pages read dropped from the page cache), while the file at the mapped path
    is still the mapped inode (a cold mapping is faulted in a page at a time;
    ``pread`` reads each 8 MiB piece in one call). A file replaced since is
    read through the mapping, which keeps the old one, as is everything with
    ``read_file=False`` (a mapping whose memory may differ from its file).

    :meth:`pieces_keeping_cache` is the read for bytes read again soon (the
    emitter's and XNNPACK's hash during export, before the save reads them):
    the same, but the file's pages are left in the page cache (the kernel's,
    reclaimable, not this process's RSS), so the save's :meth:`pieces` reads
    them from memory, not the disk, and drops them.

    ``expectation.file``: the checkpoint file's identity when it was opened
    (mapped). While the mapped path is still that inode, the file must still
    have that identity before and after every read (its first bytes included),
    through ``pread`` or the mapping alike: a file rewritten in place since it
    was opened is refused, never read half old, half new.

    Raises:
        IntegrityError: the checkpoint file was truncated, or changed since it
            was opened (``expectation.file``) or (``read_file``) while it was
            read; the message names the file and the source's label (its key).
    """

    def __init__(self, tensor: torch.Tensor, mapping: FileMapping, label: str = "tensor",
                 read_file: bool | None = None, expectation: Expectation = NO_EXPECTATION) -> None:
        super().__init__(tensor, label)
        self.mapping = mapping
        self.read_file = read_file
        self._expectation = expectation

    #: Its bytes are a mapped checkpoint's: checked against the file before
    #: reading, not digested at hand-over (a second read of the checkpoint).
    is_mutable = False

    def _file_range(self) -> FileRangeSource | None:
        """The same bytes as a file range, if the mapped path is still the mapped file."""
        m = self.mapping
        if m.path.endswith(" (deleted)"):
            return None
        try:
            source = FileRangeSource(m.path, m.offset + (self._address() - m.start), self.nbytes,
                                     Expectation(file=self.expectation.file))
        except (OSError, LayoutError):
            return None
        if source.identity[1] != m.inode:
            return None  # replaced: only the mapping still has the handed-over bytes
        return source

    def _check_file(self) -> None:
        m = self.mapping
        if m.path.endswith(" (deleted)"):
            return  # unlinked: nobody can reach it by name to change it
        now = same_inode_now(m.path, m.inode)
        if now is None:
            return  # unlinked or replaced since it was mapped: the mapping keeps the old inode, unchanged
        opened = self.expectation.file
        if opened is not None and now != opened:
            raise IntegrityError(
                f"{self.describe()}: its checkpoint file {m.path} was written to after it was "
                f"opened (device, inode, size, modification and change time {tuple(opened)} then, "
                f"{tuple(now)} now); nothing is written from it: a checkpoint "
                "must not change while it is saved"
            )
        needed = m.offset + (self._address() - m.start) + self.nbytes
        if now.size < needed:
            raise IntegrityError(
                f"{self.describe()}: its checkpoint file {m.path} was truncated after "
                f"it was mapped (needs {needed:,} bytes, has {now.size:,})"
            )

    def _readable_range(self) -> FileRangeSource | None:
        """:meth:`_file_range` when the memory shows the file's bytes: ``read_file``,
        or (``read_file=None``) no page of the range is a private copy made by a
        write (:func:`~ptdstream.system.pagecache.private_copies`)."""
        if self.read_file is False or (self.read_file is None
                                       and private_copies(self._address(), self.nbytes) is not False):
            return None
        return self._file_range()

    def pieces(self, ring: BufferRing) -> Iterator[memoryview]:
        yield from self._pieces(ring, keep_cache=False)

    def pieces_keeping_cache(self, ring: BufferRing) -> Iterator[memoryview]:
        """The pieces of :meth:`pieces` (same checks, same errors), the file's
        pages left in the page cache: read with ``pread`` where the memory shows
        the file's bytes (nothing mapped in), else through the mapping, each
        piece unmapped once copied
        (:func:`~ptdstream.system.pagecache.release_mapped`)."""
        yield from self._pieces(ring, keep_cache=True)

    def _pieces(self, ring: BufferRing, keep_cache: bool) -> Iterator[memoryview]:
        self._check_file()
        file_range = self._readable_range()
        if file_range is not None:
            try:
                yield from file_range.pieces(ring, keep_cache=keep_cache)
            except IntegrityError as e:
                raise IntegrityError(f"{self.describe()}: {e}") from None
            return
        yield from self._mapped_pieces(ring, keep_cache)

    def _mapped_pieces(self, ring: BufferRing, keep_cache: bool) -> Iterator[memoryview]:
        view = self._view()
        address = self._address()
        step = ring.chunk_nbytes
        bounds = (self.mapping.start, self.mapping.stop)
        release = release_mapped if keep_cache else page_out
        will_need(address, 2 * step, bounds)
        for start in range(0, self.nbytes, step):
            will_need(address + start + 2 * step, step, bounds)  # keep two pieces ahead
            piece = view[start : start + step]
            buf = ring.next()[: len(piece)]
            buf[:] = piece
            release(address + start, len(piece), bounds)
            yield buf
        self._check_file()  # the mapping shows a file written to in place: not torn

    def prefix(self, nbytes: int = 32) -> bytes:
        self._check_file()
        file_range = self._file_range() if self.read_file else None
        if file_range is not None:
            head = file_range.prefix(nbytes)
        else:
            head = super().prefix(nbytes)
            # The fault maps (and reads ahead) more than the page it needs: unmapped again, the page
            # cache kept (the prefix is read while exporting, right before the hash reads the rest).
            release_mapped(self._address(), min(self.nbytes, 1 << 20), (self.mapping.start, self.mapping.stop))
        self._check_file()
        return head
