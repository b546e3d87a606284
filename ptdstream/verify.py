"""Check written artifacts: byte identity with a reference, and structure.

* :func:`compare_files`: two files, streamed side by side in fixed pieces.
* :func:`verify_against_manager`: saved files against the manager's own upstream
  serialization, streamed from its ``Cord`` pieces; the reference is never
  written to disk nor joined into one ``bytes``.
* :func:`check_structure`: the checks the C++ loader makes (headers, bounds,
  constant offsets, named keys) plus cross-file ones (every external tensor the
  program needs is a key of a given .ptd, with the same layout).

Reports are frozen dataclasses with ``ok``, ``summary()`` and ``to_json()``.
Host memory: two pieces of ``chunk_nbytes`` (8 MiB) plus the metadata
flatbuffers; pages read from files are dropped from the page cache as the
comparison passes them. Nothing is written.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from . import _upstream
from .errors import FormatError
from .pagecache import drop_pages
from .reader import Artifact, parse_artifact, read_artifact

DEFAULT_CHUNK_NBYTES = 8 << 20
_SUPPORTED_PTD_VERSION = 0  # FlatTensorDataMap::kMaxSupportedSchemaVersion


@dataclass(frozen=True)
class CompareReport:
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
    out_nbytes: Optional[int]
    ref_nbytes: int
    first_diff_offset: Optional[int] = None
    section: Optional[str] = None
    key: Optional[str] = None
    out_byte: Optional[int] = None
    ref_byte: Optional[int] = None
    map_source: Optional[str] = None
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
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

    def to_dict(self) -> dict:
        return dict(asdict(self), ok=self.ok)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _byte(value: Optional[int]) -> str:
    return "<end of file>" if value is None else f"0x{value:02x}"


class _FileFiller:
    """Fills a buffer from a file in order; drops the pages it read."""

    def __init__(self, f) -> None:
        self.f, self.pos = f, 0

    def fill(self, buf: bytearray) -> int:
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = self.f.readinto(view[got:])
            if not n:
                break
            got += n
        if got:
            drop_pages(self.f.fileno(), self.pos, got)
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


def _first_difference(a, b, chunk_nbytes: int) -> Tuple[Optional[int], Optional[int], Optional[int]]:
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


def _name_offset(offset: Optional[int], maps: Sequence[Tuple[str, Callable[[], Artifact]]]):
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


def compare_files(out_path: str, ref_path: str, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES) -> CompareReport:
    """Compare ``out_path`` with ``ref_path`` byte for byte, streaming.

    Memory: two buffers of ``chunk_nbytes`` bytes. A mismatch is named from the
    reference's section map, or the output's if the reference does not parse.

    Raises:
        OSError: either file cannot be opened or read (missing, permission).
        ValueError: ``chunk_nbytes <= 0``.
    """
    out_path, ref_path = os.fspath(out_path), os.fspath(ref_path)
    with open(out_path, "rb") as fo, open(ref_path, "rb") as fr:
        out_n, ref_n = os.fstat(fo.fileno()).st_size, os.fstat(fr.fileno()).st_size
        offset, ob, rb = _first_difference(_FileFiller(fo), _FileFiller(fr), chunk_nbytes)
    section, key, source = _name_offset(
        offset, [("reference", lambda: read_artifact(ref_path)), ("output", lambda: read_artifact(out_path))]
    )
    return CompareReport(out_path, ref_path, out_n, ref_n, offset, section, key, ob, rb, source)


def _cord_read_at(cord, chunk_nbytes: int) -> Callable[[int, int], bytes]:
    def read_at(offset: int, count: int) -> bytes:
        out, pos = bytearray(), 0
        pieces = _upstream.cord_pieces(cord, chunk_nbytes)
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
        f = open(out_path, "rb")
    except FileNotFoundError:
        return CompareReport(out_path, ref_label, None, ref_n, error="expected file is missing")
    with f:
        out_n = os.fstat(f.fileno()).st_size
        offset, ob, rb = _first_difference(
            _FileFiller(f), _PieceFiller(_upstream.cord_pieces(cord, chunk_nbytes)), chunk_nbytes
        )
    maps = [("reference", lambda: parse_artifact(ref_label, ref_n, _cord_read_at(cord, chunk_nbytes))),
            ("output", lambda: read_artifact(out_path))]
    section, key, source = _name_offset(offset, maps)
    return CompareReport(out_path, ref_label, out_n, ref_n, offset, section, key, ob, rb, source)


def verify_against_manager(
    manager, pte_path: str, data_dir: Optional[str] = None, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES
) -> List[CompareReport]:
    """Compare saved files with ``manager``'s own upstream serialization.

    The reference is streamed from the manager's ``Cord`` pieces (never written,
    never joined). Files: ``pte_path`` and ``<data_dir>/<tag>.ptd`` for each tag
    of the manager's data files (``data_dir`` defaults to the .pte's folder).

    Returns:
        One :class:`CompareReport` per file, the .pte first; a missing file is a
        report with ``error`` set.

    Raises:
        OSError: a file exists but cannot be read.
        LayoutError: a tag that cannot name a file (see ``save.ptd_file_name``).
    """
    from .save import ptd_file_name

    pte_path = os.fspath(pte_path)
    folder = data_dir if data_dir is not None else (os.path.dirname(pte_path) or ".")
    pte_cord, tensor_cords = _upstream.reference_cords(manager)
    reports = [_compare_cord(pte_path, f"<upstream {os.path.basename(pte_path)}>", pte_cord, chunk_nbytes)]
    for tag, cord in tensor_cords.items():
        name = ptd_file_name(tag)
        reports.append(_compare_cord(os.path.join(folder, name), f"<upstream {name}>", cord, chunk_nbytes))
    return reports


@dataclass(frozen=True)
class Check:
    """One structural check: the file it concerns, its name, result and detail."""

    path: str
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class StructureReport:
    """All checks :func:`check_structure` made; ``ok`` when every one passed."""

    pte_path: str
    ptd_paths: Tuple[str, ...]
    checks: Tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def problems(self) -> Tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def summary(self) -> str:
        """One line per check, then a verdict line."""
        lines = [f"{'ok  ' if c.ok else 'FAIL'} {c.path}: {c.name}: {c.detail}" for c in self.checks]
        n = len(self.problems)
        lines.append("OK: structure valid" if self.ok else f"INVALID: {n} check{'s' * (n != 1)} failed")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return dict(asdict(self), ok=self.ok)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _file_checks(path: str, art: Artifact, expected_kind: str) -> List[Check]:
    checks = [Check(path, "kind", art.kind == expected_kind,
                    f"{art.kind} (identifier {art.identifier}); expected {expected_kind}")]
    want = "ET12" if art.kind == "pte" else "FT01"
    checks.append(Check(path, "identifier", art.identifier == want, f"{art.identifier}, runtime expects {want}"))
    h = art.header
    if h is None:
        checks.append(Check(path, "header", True, "no extended header: raw program flatbuffer, no segment data"))
    else:
        checks.append(Check(path, "header", True, f"{h.MAGIC.decode()} length {h.length}"))
    checks.append(Check(path, "flatbuffer", True, f"parses ({art.flatbuffer_end:,} bytes with header)"))
    end = art.segment_base_offset + art.segment_data_nbytes
    checks.append(Check(path, "segments in bounds", True,
                        f"{len(art.segments)} segment{'' if len(art.segments) == 1 else 's'}; base {art.segment_base_offset:,} + data "
                        f"{art.segment_data_nbytes:,} = {end:,} <= file size {art.file_nbytes:,}"))
    if art.constant_segment_index is not None:
        seg = art.segments[art.constant_segment_index]
        checks.append(Check(path, "constant offsets", True,
                            f"{len(art.constant_offsets)} offset{'' if len(art.constant_offsets) == 1 else 's'} within segment {seg.index} ({seg.nbytes:,} bytes)"))
    checks.append(Check(path, "named keys", True, f"{len(art.named)} keys resolve to segments"))
    counts: Dict[str, int] = {}
    for e in art.named:
        counts[e.key] = counts.get(e.key, 0) + 1
    dups = sorted(k for k, n in counts.items() if n > 1)
    checks.append(Check(path, "keys unique", not dups, f"duplicate keys: {_names(dups)}" if dups else "no key repeats"))
    if art.kind == "ptd":
        checks.append(Check(path, "version", art.version <= _SUPPORTED_PTD_VERSION,
                            f"FlatTensor version {art.version}, runtime supports <= {_SUPPORTED_PTD_VERSION}"))
    return checks


def _names(keys: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_structure(pte_path: str, ptd_paths: Sequence[str] = ()) -> StructureReport:
    """Check a .pte and its .ptd files the way the runtime would load them.

    Per file: kind and identifier, header, flatbuffer parse, segments within the
    file, constant offsets within the constant segment, named keys resolving to
    segments and unique, .ptd version. Across files: every tensor the program
    marks EXTERNAL is a key of some .ptd (layouts equal where the .ptd records
    one), and no key is in two .ptd files. Keys that only a backend's blob
    references (XNNPACK weights in a .ptd) cannot be checked.

    Raises:
        OSError: a file cannot be opened or read (an invalid file is a failed check).
    """
    pte_path = os.fspath(pte_path)
    ptd_paths = tuple(os.fspath(p) for p in ptd_paths)
    checks: List[Check] = []
    arts: Dict[str, Artifact] = {}
    for path, kind in [(pte_path, "pte")] + [(p, "ptd") for p in ptd_paths]:
        try:
            arts[path] = read_artifact(path)
        except FormatError as e:
            checks.append(Check(path, "parse", False, str(e)))
            continue
        checks.extend(_file_checks(path, arts[path], kind))
    pte = arts.get(pte_path)
    ptds = [arts[p] for p in ptd_paths if p in arts and arts[p].kind == "ptd"]
    owners: Dict[str, List[str]] = {}
    for art in ptds:
        for e in art.named:
            if art.path not in owners.setdefault(e.key, []):
                owners[e.key].append(art.path)
    if ptds:
        shared = sorted(k for k, paths in owners.items() if len(paths) > 1)
        checks.append(Check(pte_path, "keys unique across .ptd files", not shared,
                            f"in several files: {_names(shared)}" if shared else f"{len(owners)} keys"))
    if pte is not None and pte.kind == "pte":
        checks.extend(_external_checks(pte_path, pte, ptds))
    return StructureReport(pte_path, ptd_paths, tuple(checks))


def _external_checks(pte_path: str, pte: Artifact, ptds: List[Artifact]) -> List[Check]:
    if not pte.external_tensors:
        return [Check(pte_path, "external data", True, "the program marks no tensor EXTERNAL (keys only a backend blob "
                      "references cannot be checked)")]
    layouts = {}
    for art in ptds:
        for e in art.named:
            layouts.setdefault(e.key, (art.path, e.layout))
    missing = [t.fqn for t in pte.external_tensors if t.fqn not in layouts]
    checks = [Check(pte_path, "external data", not missing,
                    f"missing from the given .ptd files: {_names(missing)}" if missing
                    else f"all {len(pte.external_tensors)} external tensors found")]
    wrong = [f"{t.fqn!r} program {t.layout} vs {layouts[t.fqn][0]} {layouts[t.fqn][1]}"
             for t in pte.external_tensors
             if t.fqn in layouts and layouts[t.fqn][1] is not None and layouts[t.fqn][1] != t.layout]
    checks.append(Check(pte_path, "external layouts", not wrong,
                        "; ".join(wrong[:3]) if wrong else "layouts match where recorded"))
    return checks
