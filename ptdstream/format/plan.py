"""Plans: every byte of an output file, decided before any payload moves.

A :class:`FilePlan` is plain, frozen data: an ordered tuple of :class:`Extent`
(metadata bytes, zero padding, or a source's payload), the section each belongs
to and the keys that name it. The writer streams extents in order; the dry run
prints them; tests compare them with the reference layout without I/O. A
:class:`SavePlan` is the plans of one set of files (a program and its data
files), each with its path and role.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..sources.base import Source
from ..sources.fingerprint import PREFIX_NBYTES, Fingerprint
from .layout import Placement, SegmentSpec, place_segments

__all__ = ["DataEntry", "Extent", "ExtentKind", "FilePlan", "FileRole", "PlannedFile", "SavePlan",
           "SegmentPlan", "assemble", "named_segments", "place"]


@dataclass(frozen=True)
class DataEntry:
    """One named-data key's entry: the index of its buffer, its alignment (bytes)
    and its tensor layout (an executorch ``TensorLayout``, or None).

    Same fields as upstream's ``exir/_serialize/data_serializer.py::DataEntry``.
    """

    buffer_index: int
    alignment: int
    tensor_layout: Any = None


class ExtentKind(Enum):
    METADATA = "metadata"  # bytes held in the plan: header, flatbuffer, its padding
    ZEROS = "zeros"  # zero padding
    SOURCE = "source"  # payload streamed from a source


@dataclass(frozen=True)
class Extent:
    """A run of output bytes.

    Attributes:
        kind: what fills it.
        nbytes: its length in bytes.
        section: the section it belongs to ("head", "segment 3", ...).
        data: the bytes, for ``METADATA`` only.
        source: the payload, for ``SOURCE`` only.
        keys: the named-data keys or descriptions naming this payload.
        fingerprint: the digest the payload must have, when known at plan time.
        prefix: the payload's first bytes as seen at plan time (integrity check).
    """

    kind: ExtentKind
    nbytes: int
    section: str
    data: bytes | None = None
    source: Source | None = None
    keys: tuple[str, ...] = ()
    fingerprint: Fingerprint | None = None
    prefix: bytes = b""

    @staticmethod
    def metadata(data: bytes, section: str) -> Extent:
        """An extent of bytes the plan holds (headers, flatbuffers)."""
        return Extent(ExtentKind.METADATA, len(data), section, data=data)

    @staticmethod
    def zeros(nbytes: int, section: str) -> Extent:
        """An extent of ``nbytes`` zero bytes (padding)."""
        return Extent(ExtentKind.ZEROS, nbytes, section)

    @staticmethod
    def payload(
        source: Source,
        section: str,
        keys: Sequence[str] = (),
        fingerprint: Fingerprint | None = None,
    ) -> Extent:
        """An extent streamed from ``source``, its first bytes taken now (``prefix``); ``keys`` and
        ``fingerprint`` as the attributes."""
        return Extent(
            ExtentKind.SOURCE,
            source.nbytes,
            section,
            source=source,
            keys=tuple(keys),
            fingerprint=fingerprint,
            prefix=source.prefix(PREFIX_NBYTES),
        )

    def label(self) -> str:
        """``section`` plus the keys, for messages."""
        if self.keys:
            return f"{self.section} (key {', '.join(repr(k) for k in self.keys)})"
        return self.section


@dataclass(frozen=True)
class SegmentPlan:
    """One segment before placement: its parts in order and its own alignment."""

    parts: tuple[Extent, ...]
    alignment: int
    label: str

    @property
    def nbytes(self) -> int:
        """The segment's length in bytes: its parts', padding parts included."""
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True)
class FilePlan:
    """Everything the writer needs for one file.

    Attributes:
        kind: ``"pte"`` or ``"ptd"``.
        name: the file name the plan is for (``model.pte``, ``<tag>.ptd``).
        extents: every byte of the file, in order.
        nbytes: the file's size in bytes.
        segment_base_offset: file offset of segment 0 (0 when there is no segment data).
        placements: each segment's offset (relative to the base) and size.
        flatbuffer_nbytes: the metadata flatbuffer's size in bytes, header excluded.
    """

    kind: str
    name: str
    extents: tuple[Extent, ...]
    nbytes: int
    segment_base_offset: int
    placements: tuple[Placement, ...]
    flatbuffer_nbytes: int

    def payload_nbytes(self) -> int:
        """Bytes streamed from sources (not metadata, not padding)."""
        return sum(e.nbytes for e in self.extents if e.kind is ExtentKind.SOURCE)

    def describe(self) -> list[str]:
        """One line per extent: file offset, size, kind and label (the dry run)."""
        lines = []
        offset = 0
        for e in self.extents:
            lines.append(f"{offset:>14} {e.nbytes:>14} {e.kind.value:<8} {e.label()}")
            offset += e.nbytes
        return lines


def place(segments: Sequence[SegmentPlan], segment_alignment: int) -> tuple[tuple[Placement, ...], int]:
    """Placements of ``segments`` (the one layout rule, :func:`layout.place_segments`)."""
    return place_segments(
        [SegmentSpec(s.nbytes, s.alignment) for s in segments], segment_alignment
    )


def assemble(
    kind: str,
    name: str,
    head: bytes,
    segment_base_offset: int,
    segments: Sequence[SegmentPlan],
    placements: Sequence[Placement],
    flatbuffer_nbytes: int,
) -> FilePlan:
    """Lay out head, zero gaps and segment parts into a :class:`FilePlan`."""
    extents: list[Extent] = [Extent.metadata(head, "head")]
    end = 0
    for index, (segment, placement) in enumerate(zip(segments, placements, strict=True)):
        gap = placement.offset - end
        if gap:
            extents.append(Extent.zeros(gap, f"padding before segment {index}"))
        extents.extend(p for p in segment.parts if p.nbytes)
        end = placement.end
    total = len(head) + (end if segments else 0)
    return FilePlan(
        kind=kind,
        name=name,
        extents=tuple(e for e in extents if e.nbytes),
        nbytes=total,
        segment_base_offset=segment_base_offset,
        placements=tuple(placements),
        flatbuffer_nbytes=flatbuffer_nbytes,
    )


def named_segments(
    buffers: Sequence[Source],
    named_data: Mapping[str, DataEntry],
    segments: list[SegmentPlan],
    fingerprints: Mapping[int, Fingerprint] | None = None,
) -> list[tuple[str, int]]:
    """Append one segment per buffer, in key order, the first time it is named,
    with that key's alignment; return ``[(key, segment index)]``.

    The named-data rule both serializers share (``_program.py::serialize_pte_binary``
    and ``FlatTensorSerializer.serialize``): keys naming one buffer share its segment.
    """
    segment_of: dict[int, int] = {}
    keys_of: dict[int, list[str]] = {}
    for key, entry in named_data.items():
        keys_of.setdefault(entry.buffer_index, []).append(key)
    result = []
    for key, entry in named_data.items():
        index = segment_of.get(entry.buffer_index)
        if index is None:
            index = len(segments)
            segment_of[entry.buffer_index] = index
            fp = (fingerprints or {}).get(entry.buffer_index)
            extent = Extent.payload(buffers[entry.buffer_index], "named data", keys_of[entry.buffer_index], fp)
            segments.append(SegmentPlan((extent,), entry.alignment, "named data"))
        result.append((key, index))
    return result


class FileRole(Enum):
    """What a file of a set is: the program (.pte) or a data file (.ptd)."""

    PROGRAM = "program"
    DATA = "data"


@dataclass(frozen=True)
class PlannedFile:
    """One file of a set: where it goes, what it is, and its plan."""

    path: str
    role: FileRole
    plan: FilePlan


@dataclass(frozen=True)
class SavePlan:
    """The plans of one set of files: the data files and, unless only data files
    are written, the program.

    Attributes:
        data_files: the .ptd files, in the order upstream names their tags.
        program: the .pte, or None (``write_data_files``).
        options: the layout parameters used (a ``PteOptions``).
        dedup_saved_nbytes: bytes not written because equal data was stored once.
    """

    data_files: tuple[PlannedFile, ...]
    program: PlannedFile | None
    options: Any
    dedup_saved_nbytes: int

    def __post_init__(self) -> None:
        roles = [f.role for f in self.data_files] + ([self.program.role] if self.program else [])
        if roles.count(FileRole.PROGRAM) != (1 if self.program else 0) or (
            self.program is not None and self.program.role is not FileRole.PROGRAM
        ):
            raise ValueError("a SavePlan holds data files in data_files and at most one program")

    @property
    def files(self) -> tuple[PlannedFile, ...]:
        """Every file in publish order: the data files first, the program last (a
        reader that finds the program finds every file it needs)."""
        return self.data_files + ((self.program,) if self.program is not None else ())

    @property
    def nbytes(self) -> int:
        """Bytes of every file together."""
        return sum(f.plan.nbytes for f in self.files)

    def without_program(self) -> SavePlan:
        """The same plan with only the data files."""
        return SavePlan(self.data_files, None, self.options, self.dedup_saved_nbytes)
