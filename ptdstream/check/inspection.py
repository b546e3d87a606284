"""What is in a set of .pte/.ptd files: sections, keys, sizes, alignments, and
content stored more than once.

:func:`inspect_files` reads each file's section map (:mod:`ptdstream.format.reader`),
then streams every data unit through xxh3-128 in pieces: each non-empty segment,
except the constant segment, which is split into its tensors (the range from
one constant offset to the next, so the alignment padding after each tensor but
the last is included). Units with equal size and digest are grouped as
duplicates, within one file or across files. Host memory: one piece of
``chunk_nbytes`` plus the metadata; pages read are dropped from the page cache.
Nothing is written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..defaults import CHUNK_NBYTES
from ..format.artifact import Section, TensorMeta
from ..format.fb_roots import shown
from ..format.reader import Artifact, read_artifact
from ..reports import Report
from ..sources import BufferRing, FileRangeSource
from ..sources.fingerprint import StreamingDigest

__all__ = ["InspectReport", "alignment_of", "inspect_files"]

_METADATA = {"flatbuffer", "extended header", "flat tensor header"}
_PADDING = {"padding", "header padding"}


def alignment_of(offset: int) -> int | None:
    """Largest power of two dividing ``offset`` (bytes); None for offset 0 (any)."""
    return offset & -offset if offset > 0 else None


@dataclass(frozen=True)
class SegmentInfo:
    """A segment: index, label, keys, absolute ``[start, end)`` (bytes), offset
    relative to the segment base, size, and the alignment of ``start``."""

    index: int
    label: str
    keys: tuple[str, ...]
    offset: int
    start: int
    end: int
    nbytes: int
    alignment: int | None


@dataclass(frozen=True)
class KeyInfo:
    """A named-data key, its segment, size in bytes and (in a .ptd) tensor layout."""

    key: str
    segment_index: int
    nbytes: int
    layout: TensorMeta | None


@dataclass(frozen=True)
class BreakdownRow:
    """Bytes of one category: ``metadata`` (headers, flatbuffer), ``padding``,
    ``payload`` (one row per non-empty segment) or ``trailing``."""

    category: str
    name: str
    key: str | None
    nbytes: int


@dataclass(frozen=True)
class FileInspection:
    """One file. The ``breakdown`` rows add up to ``file_nbytes``."""

    path: str
    kind: str
    identifier: str
    file_nbytes: int
    header: dict | None
    segment_base_offset: int
    sections: tuple[Section, ...]
    segments: tuple[SegmentInfo, ...]
    keys: tuple[KeyInfo, ...]
    breakdown: tuple[BreakdownRow, ...]

    def total(self, category: str) -> int:
        """Bytes of ``category`` in this file."""
        return sum(r.nbytes for r in self.breakdown if r.category == category)


@dataclass(frozen=True)
class DuplicateMember:
    """Where one copy lives: file, segment index, label, key, absolute start."""

    path: str
    segment_index: int
    label: str
    key: str | None
    start: int


@dataclass(frozen=True)
class DuplicateGroup:
    """Equal content (size and xxh3-128 digest) stored ``len(members)`` times."""

    nbytes: int
    digest: str
    members: tuple[DuplicateMember, ...]

    @property
    def duplicated_nbytes(self) -> int:
        """Bytes beyond the first copy."""
        return self.nbytes * (len(self.members) - 1)


@dataclass(frozen=True)
class InspectReport(Report):
    """Every file inspected, and the duplicate groups across all of them."""

    files: tuple[FileInspection, ...]
    duplicates: tuple[DuplicateGroup, ...]

    @property
    def duplicated_nbytes(self) -> int:
        """Bytes stored more than once, over every group of duplicates."""
        return sum(g.duplicated_nbytes for g in self.duplicates)

    derived = ("duplicated_nbytes",)

    def to_dict(self) -> dict:
        out = super().to_dict()
        for f, fd in zip(self.files, out["files"], strict=True):
            fd["totals"] = {c: f.total(c) for c in ("metadata", "padding", "payload", "trailing")}
        return out

    def summary(self) -> str:
        """Human-readable text: per file, its sections, segments, keys and breakdown."""
        lines: list[str] = []
        for f in self.files:
            lines += _file_text(f)
        if self.duplicates:
            lines.append(f"duplicated content: {self.duplicated_nbytes:,} bytes in {len(self.duplicates)} groups")
            for g in self.duplicates:
                lines.append(f"  {g.nbytes:,} bytes x{len(g.members)} (xxh3-128 {g.digest[:16]}...)")
                for m in g.members:
                    lines.append(f"    {m.path} @ {m.start:,}: {m.label}" + (f" {shown(m.key, True)}" if m.key else ""))
        else:
            lines.append("duplicated content: none")
        return "\n".join(lines)


def _file_text(f: FileInspection) -> list[str]:
    lines = [f"{f.path}: {f.kind} ({f.identifier}), {f.file_nbytes:,} bytes"]
    if f.header is not None:
        lines.append("  header: " + ", ".join(f"{k} {v:,}" for k, v in f.header.items()))
    lines.append("  sections:")
    for s in f.sections:
        key = f" {shown(s.key, True)}" if s.key else ""
        lines.append(f"    [{s.start:>10,} {s.end:>10,})  {s.nbytes:>10,}  {s.name}{key}")
    if f.segments:
        lines.append("  segments:")
    for seg in f.segments:
        align = "any" if seg.alignment is None else f"{seg.alignment:,}"
        lines.append(f"    #{seg.index:<3} {seg.label:<28} offset {seg.offset:>10,}  size {seg.nbytes:>10,}  "
                     f"at {seg.start:>10,}  aligned {align}")
    if f.keys:
        lines.append(f"  keys ({len(f.keys)}):")
    for k in f.keys:
        layout = f"  {_dtype_name(k.layout.scalar_type)} sizes {list(k.layout.sizes)}" if k.layout else ""
        lines.append(f"    {shown(k.key, True)} -> segment {k.segment_index} ({k.nbytes:,} bytes){layout}")
    parts = [f"{c} {f.total(c):,}" for c in ("metadata", "padding", "payload", "trailing") if f.total(c)]
    lines.append("  bytes: " + " + ".join(parts) + f" = {f.file_nbytes:,}")
    return lines


def _breakdown(art: Artifact) -> tuple[BreakdownRow, ...]:
    totals: dict[str, int] = {}
    payload: list[BreakdownRow] = []
    for s in art.sections():
        if s.name in _METADATA:
            totals[s.name] = totals.get(s.name, 0) + s.nbytes
        elif s.name in _PADDING:
            totals["padding"] = totals.get("padding", 0) + s.nbytes
        elif s.name == "trailing bytes":
            totals["trailing bytes"] = s.nbytes
        else:
            payload.append(BreakdownRow("payload", s.name, s.key, s.nbytes))
    rows = [BreakdownRow("metadata", n, None, totals[n])
            for n in ("extended header", "flat tensor header", "flatbuffer") if n in totals]
    if "padding" in totals:
        rows.append(BreakdownRow("padding", "padding", None, totals["padding"]))
    rows += payload
    if "trailing bytes" in totals:
        rows.append(BreakdownRow("trailing", "trailing bytes", None, totals["trailing bytes"]))
    return tuple(rows)


def _inspect_one(art: Artifact) -> FileInspection:
    header = None
    if art.header is not None:
        header = {k: v for k, v in asdict(art.header).items()}
    segments = tuple(
        SegmentInfo(s.index, s.label, s.keys, s.offset, s.start, s.end, s.nbytes, alignment_of(s.start))
        for s in art.segments
    )
    keys = tuple(KeyInfo(e.key, e.segment_index, art.segments[e.segment_index].nbytes, e.layout) for e in art.named)
    return FileInspection(art.path, art.kind, art.identifier, art.file_nbytes, header,
                          art.segment_base_offset, art.sections(), segments, keys, _breakdown(art))


def _units(art: Artifact):
    """(segment index, label, key, absolute start, nbytes) of each data unit to digest."""
    for s in art.segments:
        if s.index == art.constant_segment_index and art.constant_offsets:
            offs = art.constant_offsets
            for i, lo in enumerate(offs):
                hi = offs[i + 1] if i + 1 < len(offs) else s.nbytes
                if hi > lo:
                    yield s.index, s.label, f"constant {i}", s.start + lo, hi - lo
        elif s.nbytes:
            yield s.index, s.label, (s.keys[0] if s.keys else None), s.start, s.nbytes


def inspect_files(paths: Sequence[str], chunk_nbytes: int = CHUNK_NBYTES) -> InspectReport:
    """Inspect ``paths`` (.pte/.ptd, any mix): section maps, keys, per-key sizes,
    segment alignments, and content duplicated within or across the files.

    Every data unit is read once, in pieces of ``chunk_nbytes`` bytes, and
    digested with xxh3-128.

    Raises:
        FormatError: a file is not a valid .pte/.ptd (names file and offset).
        OSError: a file cannot be opened or read.
    """
    arts = [read_artifact(os.fspath(p)) for p in paths]
    ring = BufferRing(chunk_nbytes, count=1)
    groups: dict[tuple[int, bytes], list[DuplicateMember]] = {}
    for art in arts:
        for index, label, key, start, nbytes in _units(art):
            digest = StreamingDigest()
            for piece in FileRangeSource(art.path, start, nbytes).pieces(ring):
                digest.update(piece)
            fp = digest.finish()
            groups.setdefault((fp.nbytes, fp.digest), []).append(DuplicateMember(art.path, index, label, key, start))
    dups = tuple(
        DuplicateGroup(nbytes, digest.hex(), tuple(members))
        for (nbytes, digest), members in sorted(groups.items(), key=lambda kv: -kv[0][0] * (len(kv[1]) - 1))
        if len(members) > 1
    )
    return InspectReport(tuple(_inspect_one(a) for a in arts), dups)


def _dtype_name(scalar_type: int) -> str:
    """ExecuTorch ``ScalarType`` number -> its name ("FLOAT", "BFLOAT16"), or the number."""
    from ..format.program_fb.ScalarType import ScalarType  # flatc's enum of scalar_type.fbs

    names = {v: k for k, v in vars(ScalarType).items() if not k.startswith("_") and isinstance(v, int)}
    return names.get(scalar_type, f"scalar_type {scalar_type}")
