"""Plans: every byte of an output file, decided before any payload moves.

A :class:`FilePlan` is plain, frozen data: an ordered tuple of :class:`Extent`
(metadata bytes, zero padding, or a source's payload), the section each belongs
to and the keys that name it. The writer streams extents in order; the dry run
prints them; tests compare them with the reference layout without I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, List, Optional, Sequence, Tuple

from .fingerprint import Fingerprint
from .layout import Placement, SegmentSpec, place_segments
from .sources import Source


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
    data: Optional[bytes] = None
    source: Optional[Source] = None
    keys: Tuple[str, ...] = ()
    fingerprint: Optional[Fingerprint] = None
    prefix: bytes = b""

    @staticmethod
    def metadata(data: bytes, section: str) -> "Extent":
        return Extent(ExtentKind.METADATA, len(data), section, data=data)

    @staticmethod
    def zeros(nbytes: int, section: str) -> "Extent":
        return Extent(ExtentKind.ZEROS, nbytes, section)

    @staticmethod
    def payload(
        source: Source,
        section: str,
        keys: Sequence[str] = (),
        fingerprint: Optional[Fingerprint] = None,
    ) -> "Extent":
        return Extent(
            ExtentKind.SOURCE,
            source.nbytes,
            section,
            source=source,
            keys=tuple(keys),
            fingerprint=fingerprint,
            prefix=source.prefix(32),
        )

    def label(self) -> str:
        """``section`` plus the keys, for messages."""
        if self.keys:
            return f"{self.section} (key {', '.join(repr(k) for k in self.keys)})"
        return self.section


@dataclass(frozen=True)
class SegmentPlan:
    """One segment before placement: its parts in order and its own alignment."""

    parts: Tuple[Extent, ...]
    alignment: int
    label: str

    @property
    def nbytes(self) -> int:
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
        segment_labels: what each segment holds ("constant segment", "named data", ...).
        flatbuffer_nbytes: the metadata flatbuffer's size in bytes, header excluded.
    """

    kind: str
    name: str
    extents: Tuple[Extent, ...]
    nbytes: int
    segment_base_offset: int
    placements: Tuple[Placement, ...]
    segment_labels: Tuple[str, ...]
    flatbuffer_nbytes: int

    def payload_nbytes(self) -> int:
        """Bytes streamed from sources (not metadata, not padding)."""
        return sum(e.nbytes for e in self.extents if e.kind is ExtentKind.SOURCE)

    def describe(self) -> List[str]:
        """One line per extent: file offset, size, kind and label (the dry run)."""
        lines = []
        offset = 0
        for e in self.extents:
            lines.append(f"{offset:>14} {e.nbytes:>14} {e.kind.value:<8} {e.label()}")
            offset += e.nbytes
        return lines


def place(segments: Sequence[SegmentPlan], segment_alignment: int) -> Tuple[Tuple[Placement, ...], int]:
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
    extents: List[Extent] = [Extent.metadata(head, "head")]
    end = 0
    for index, (segment, placement) in enumerate(zip(segments, placements)):
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
        segment_labels=tuple(s.label for s in segments),
        flatbuffer_nbytes=flatbuffer_nbytes,
    )


def iter_sources(plans: Iterable[FilePlan]):
    """Every payload extent of ``plans``, in write order."""
    for plan in plans:
        for e in plan.extents:
            if e.kind is ExtentKind.SOURCE:
                yield plan, e
