"""Byte identity: an output against a reference, streamed side by side.

* :func:`compare_files`: two files, streamed side by side in fixed pieces.
* :func:`verify_against_manager`: saved files against the manager's own upstream
  serialization, streamed from its ``Cord`` pieces; the reference is never
  written to disk nor joined into one ``bytes``.

A difference is named by the section and key of the reference's section map
(:mod:`ptdstream.format.reader`). Host memory: two pieces of ``chunk_nbytes``
(8 MiB) plus the metadata flatbuffers; pages read from files are dropped from the
page cache as the comparison passes them. Nothing is written.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass

from ..defaults import CHUNK_NBYTES
from ..errors import FormatError
from ..format.identity import kind_of
from ..format.ptd import ptd_file_name
from ..format.reader import Artifact, parse_artifact, read_artifact
from ..progress import progress_callback
from ..reports import Report
from ..sources import BufferRing, as_source
from ..system.files import open_input
from ..system.pagecache import drop_read
from ..upstream import adapter

__all__ = ["CompareReport", "compare_files", "cord_pieces", "verify_against_manager"]


@dataclass(frozen=True)
class CompareReport(Report):
    """Result of comparing an output with a reference, byte for byte.

    ``first_diff_offset`` is the first file offset (bytes) where they differ (the
    shorter one's size when one is a prefix of the other), None when identical.
    ``section``/``key`` name that offset in ``map_source``'s section map (the
    reference's, else the output's when the reference does not parse).
    ``out_byte``/``ref_byte`` are the differing bytes (None past a file's end).
    ``error`` is set when the output could not be compared (missing file).
    """

    out_path: str
    ref_path: str
    out_nbytes: int | None
    ref_nbytes: int
    first_diff_offset: int | None = None
    section: str | None = None
    key: str | None = None
    out_byte: int | None = None
    ref_byte: int | None = None
    map_source: str | None = None
    error: str | None = None

    derived = ("ok",)

    @property
    def ok(self) -> bool:
        """Whether the output could be compared and equals the reference, byte for byte."""
        return self.error is None and self.first_diff_offset is None

    def summary(self) -> str:
        """One line: OK, or where and how the files differ."""
        if self.error is not None:
            return f"MISMATCH {self.out_path}: {self.error} (reference {self.ref_path}, {self.ref_nbytes:,} bytes)"
        if self.ok:
            return f"OK {self.out_path}: identical to {self.ref_path} ({self.ref_nbytes:,} bytes)"
        where = self.section or "unmapped bytes"
        if self.key is not None:
            where += f" {self.key!r}"
        return (
            f"MISMATCH {self.out_path}: first difference at offset {self.first_diff_offset:,} "
            f"(0x{self.first_diff_offset:x}) in {where}: output {_byte(self.out_byte)}, "
            f"reference {_byte(self.ref_byte)}; sizes: output {self.out_nbytes:,}, reference {self.ref_nbytes:,} bytes"
        )



def _byte(value: int | None) -> str:
    return "<end of file>" if value is None else f"0x{value:02x}"


class _FileFiller:
    """Fills a buffer from a file in order; drops the pages it read; calls
    ``progress(nbytes)`` with the bytes of each fill."""

    def __init__(self, f, progress=None) -> None:
        self.f, self.pos, self.progress = f, 0, progress

    def fill(self, buf: bytearray) -> int:
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = self.f.readinto(view[got:])
            if not n:
                break
            got += n
        if got:
            drop_read(self.f.fileno(), self.pos, got, last=got < len(buf))
            if self.progress is not None:
                self.progress(got)
        self.pos += got
        return got


class _PieceFiller:
    """Fills a buffer from an iterator of pieces (memoryviews/bytes) of any size."""

    def __init__(self, pieces: Iterable) -> None:
        self.it, self.rest = iter(pieces), memoryview(b"")

    def fill(self, buf: bytearray) -> int:
        got = 0
        while got < len(buf):
            if not len(self.rest):
                nxt = next(self.it, None)
                if nxt is None:
                    break
                self.rest = memoryview(nxt).cast("B")
                continue
            n = min(len(self.rest), len(buf) - got)
            buf[got : got + n] = self.rest[:n]
            self.rest, got = self.rest[n:], got + n
        return got


def _first_difference(a, b, chunk_nbytes: int) -> tuple[int | None, int | None, int | None]:
    """(offset, byte of a, byte of b) of the first difference of two fillers, or Nones."""
    if chunk_nbytes <= 0:
        raise ValueError(f"chunk_nbytes must be > 0, got {chunk_nbytes}")
    buf_a, buf_b = bytearray(chunk_nbytes), bytearray(chunk_nbytes)
    offset = 0
    while True:
        na, nb = a.fill(buf_a), b.fill(buf_b)
        if na == nb == chunk_nbytes and buf_a == buf_b:
            offset += chunk_nbytes
            continue
        n = min(na, nb)
        va, vb = (buf_a, buf_b) if n == chunk_nbytes else (buf_a[:n], buf_b[:n])
        if va != vb:
            lo, hi = 0, n  # va[:lo] == vb[:lo] and va[:hi] != vb[:hi]
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if va[lo:mid] == vb[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            return offset + lo, va[lo], vb[lo]
        if na == nb:
            return None, None, None
        return offset + n, (buf_a[n] if na > n else None), (buf_b[n] if nb > n else None)


def _name_offset(offset: int | None, maps: Sequence[tuple[str, Callable[[], Artifact]]]):
    """(section, key, map source) of ``offset`` in the first map that parses and covers it."""
    if offset is None:
        return None, None, None
    for source, load in maps:
        try:
            section = load().locate(offset)
        except FormatError:
            continue
        if section is not None:
            return section.name, section.key, source
    return None, None, None


def compare_files(out_path: str, ref_path: str, chunk_nbytes: int = CHUNK_NBYTES,
                  progress=False) -> CompareReport:
    """Compare ``out_path`` with ``ref_path`` byte for byte, streaming.

    Memory: two buffers of ``chunk_nbytes`` bytes. A mismatch is named from the
    reference's section map, or the output's if the reference does not parse.
    ``progress``: ``True`` for a bar on stderr, or a callable taking the bytes of
    the reference compared so far.

    Raises:
        OSError: either file cannot be opened or read (missing, permission).
        ValueError: ``chunk_nbytes <= 0``.
    """
    out_path, ref_path = os.fspath(out_path), os.fspath(ref_path)
    with open_input(out_path) as fo, open_input(ref_path) as fr, contextlib.ExitStack() as stack:
        out_n, ref_n = os.fstat(fo.fileno()).st_size, os.fstat(fr.fileno()).st_size
        out_kind, ref_kind = kind_of(os.pread(fo.fileno(), 8, 0)[4:]), kind_of(os.pread(fr.fileno(), 8, 0)[4:])
        if out_kind is not None and ref_kind is not None and out_kind != ref_kind:  # say why, not "offset 0"
            return CompareReport(out_path, ref_path, out_n, ref_n,
                                 error=_kinds_differ(out_path, ref_path, out_kind, ref_kind))
        update = progress_callback(stack, progress, ref_n, f"comparing {os.path.basename(out_path)}")
        offset, ob, rb = _first_difference(_FileFiller(fo), _FileFiller(fr, update), chunk_nbytes)
    section, key, source = _name_offset(
        offset, [("reference", lambda: read_artifact(ref_path)), ("output", lambda: read_artifact(out_path))]
    )
    return CompareReport(out_path, ref_path, out_n, ref_n, offset, section, key, ob, rb, source)


#: How a report names each kind of file.
_KIND_NAMES = {"pte": "a program (.pte)", "ptd": "a data file (.ptd)"}


def _kinds_differ(out_path: str, ref_path: str, out_kind: str, ref_kind: str) -> str:
    """Why a .pte and a .ptd cannot be identical, and the reference's sibling of the
    output's kind when it exists (``ref/model.ptd`` given for ``out/model.pte``:
    ``ref/model.pte``)."""
    sibling = os.path.splitext(ref_path)[0] + "." + out_kind
    own = os.path.isfile(sibling) and os.path.abspath(sibling) != os.path.abspath(out_path)
    hint = f"; compare it with {sibling}" if own else f"; compare it with the reference's .{out_kind}"
    return f"{_KIND_NAMES[out_kind]} compared with {_KIND_NAMES[ref_kind]}: they cannot be identical{hint}"


def cord_pieces(cord, chunk_nbytes: int) -> Generator[memoryview, None, None]:
    """Yield a ``Cord``'s bytes in pieces without joining them (bounded memory).

    ``FileBackedData`` items (a file, or ptdstream's ``SourceBackedData``) are read
    through :func:`~ptdstream.sources.as_source`; each piece is valid until the
    next one is requested.
    """
    ring = BufferRing(chunk_nbytes, count=2)
    file_backed = adapter.file_backed_data_type()
    for item in adapter.cord_items(cord):
        if isinstance(item, file_backed):
            yield from as_source(item).pieces(ring)
        else:
            view = memoryview(item)
            for start in range(0, len(view), chunk_nbytes):
                yield view[start : start + chunk_nbytes]


def _cord_read_at(cord, chunk_nbytes: int) -> Callable[[int, int], bytes]:
    def read_at(offset: int, count: int) -> bytes:
        out, pos = bytearray(), 0
        pieces = cord_pieces(cord, chunk_nbytes)
        try:
            for piece in pieces:
                end = pos + len(piece)
                if end > offset:
                    lo = max(offset - pos, 0)
                    out += piece[lo : lo + count - len(out)]
                    if len(out) >= count:
                        break
                pos = end
        finally:
            pieces.close()
        return bytes(out)

    return read_at


def _compare_cord(out_path: str, ref_label: str, cord, chunk_nbytes: int) -> CompareReport:
    ref_n = len(cord)
    try:
        f = open_input(out_path)
    except FileNotFoundError:
        return CompareReport(out_path, ref_label, None, ref_n, error="expected file is missing")
    with f:
        out_n = os.fstat(f.fileno()).st_size
        offset, ob, rb = _first_difference(
            _FileFiller(f), _PieceFiller(cord_pieces(cord, chunk_nbytes)), chunk_nbytes
        )
    maps = [("reference", lambda: parse_artifact(ref_label, ref_n, _cord_read_at(cord, chunk_nbytes))),
            ("output", lambda: read_artifact(out_path))]
    section, key, source = _name_offset(offset, maps)
    return CompareReport(out_path, ref_label, out_n, ref_n, offset, section, key, ob, rb, source)


def reference_label(name: str) -> str:
    """How a report names the manager's own serialization of file ``name``."""
    return f"executorch's serializer of the same manager ({name}, streamed, not written)"


def verify_against_manager(
    manager, pte_path: str, data_dir: str | None = None, chunk_nbytes: int = CHUNK_NBYTES
) -> list[CompareReport]:
    """Compare saved files with ``manager``'s own upstream serialization.

    The reference is streamed from the manager's ``Cord`` pieces (never written,
    never joined). Files: ``pte_path`` and ``<data_dir>/<tag>.ptd`` for each tag
    of the manager's data files (``data_dir`` defaults to the .pte's folder).

    Returns:
        One :class:`CompareReport` per file, the .pte first; a missing file is a
        report with ``error`` set.

    Raises:
        OSError: a file exists but cannot be read.
        LayoutError: a tag that cannot name a file (see ``format.ptd.ptd_file_name``).
    """
    pte_path = os.fspath(pte_path)
    folder = data_dir if data_dir is not None else (os.path.dirname(pte_path) or ".")
    pte_cord, tensor_cords = adapter.reference_cords(manager)
    reports = [_compare_cord(pte_path, reference_label(os.path.basename(pte_path)), pte_cord, chunk_nbytes)]
    for tag, cord in tensor_cords.items():
        name = ptd_file_name(tag)
        reports.append(_compare_cord(os.path.join(folder, name), reference_label(name), cord, chunk_nbytes))
    return reports
