"""What the readers give back: an :class:`Artifact` (a file's section map) and the
checks they share on the segment table.

Every function here works on values already parsed; none reads a file.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from ..errors import FormatError
from .identity import HEADER_OFFSET, ExtendedHeader, FlatTensorHeader

__all__ = ["Artifact", "ExternalTensor", "NamedEntry", "ReadAt", "Section", "Segment",
           "TensorMeta", "check_index", "fail", "label", "segments_of", "subsegments"]

#: ``read_at(offset, nbytes) -> bytes``: random access to a file being read.
ReadAt = Callable[[int, int], bytes]


@dataclass(frozen=True)
class TensorMeta:
    """A tensor's layout as a file records it: ``scalar_type`` (ExecuTorch
    ``ScalarType`` value), sizes and dim order. (executorch's own ``TensorLayout``
    is the writer-side type; this is what the readers give back.)"""

    scalar_type: int
    sizes: tuple[int, ...]
    dim_order: tuple[int, ...]


@dataclass(frozen=True)
class Segment:
    """One data segment. ``offset`` is relative to ``segment_base_offset``; ``start``
    and ``end`` are absolute file offsets (bytes); ``keys`` are the named-data keys
    that resolve to it (several when equal data was stored once)."""

    index: int
    offset: int
    nbytes: int
    start: int
    end: int
    label: str
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class NamedEntry:
    """A named-data key, its segment index and (in a .ptd) its tensor layout."""

    key: str
    segment_index: int
    layout: TensorMeta | None = None


@dataclass(frozen=True)
class ExternalTensor:
    """A program tensor whose data lives in a .ptd under ``fqn``; ``buffer_index``
    is its ``data_buffer_idx`` (the emitter's index into its external constant
    buffers, equal for tensors whose bytes were equal at export)."""

    fqn: str
    layout: TensorMeta
    buffer_index: int = 0


@dataclass(frozen=True)
class Section:
    """A byte range ``[start, end)`` of a file, its name and key (or None)."""

    start: int
    end: int
    name: str
    key: str | None = None

    @property
    def nbytes(self) -> int:
        """The section's length in bytes."""
        return self.end - self.start


@dataclass(frozen=True)
class Artifact:
    """What :func:`read_artifact` found. All offsets and sizes are in bytes.

    ``header`` is an :class:`~ptdstream.format.identity.ExtendedHeader` (None for a .pte
    that is a raw flatbuffer) or a :class:`~ptdstream.format.identity.FlatTensorHeader`;
    ``flatbuffer_end`` ends the metadata (header included, it starts at 0);
    ``constant_offsets`` are the tensor offsets within the constant segment;
    ``delegates`` are a program's ``(method, backend id)`` pairs, in plan order.
    """

    path: str
    kind: str
    file_nbytes: int
    identifier: str
    header: ExtendedHeader | FlatTensorHeader | None
    flatbuffer_end: int
    segment_base_offset: int
    segment_data_nbytes: int
    segments: tuple[Segment, ...]
    named: tuple[NamedEntry, ...]
    constant_segment_index: int | None = None
    constant_offsets: tuple[int, ...] = ()
    external_tensors: tuple[ExternalTensor, ...] = ()
    version: int = 0
    delegates: tuple[tuple[str, str], ...] = ()

    @functools.cached_property
    def _sections(self) -> tuple[Section, ...]:
        return section_map(self)

    @property
    def keys(self) -> dict[str, int]:
        """Named-data key -> segment index."""
        return {e.key: e.segment_index for e in self.named}

    def sections(self) -> tuple[Section, ...]:
        """Non-empty sections covering ``[0, file_nbytes)`` in order, no overlap."""
        return self._sections

    def locate(self, offset: int) -> Section | None:
        """The section holding file offset ``offset``, None past the end. Inside the
        constant segment the key is ``constant <i>`` (tensor ``i`` of the segment)."""
        if not 0 <= offset < self.file_nbytes or not self._sections:
            return None
        sec = self._sections[bisect.bisect_right([s.start for s in self._sections], offset) - 1]
        if sec.name == "constant segment" and self.constant_offsets:
            i = bisect.bisect_right(self.constant_offsets, offset - sec.start) - 1
            return Section(sec.start, sec.end, sec.name, f"constant {max(i, 0)}")
        return sec


def fail(name: str, offset: int, what: str) -> FormatError:
    """A :class:`FormatError` whose one line names the file, the offset of the bad field and what is wrong."""
    return FormatError(f"{name}: at offset {offset}: {what}")


def check_index(name: str, base: int, spans: Sequence[tuple[int, int]], index: int, what: str) -> None:
    """Raise (:func:`fail`) unless ``index`` names one of ``spans``' segments; ``what`` names the referrer."""
    if not 0 <= index < len(spans):
        raise fail(name, base, f"{what} names segment {index}, but there are {len(spans)} segments")


def subsegments(name: str, base: int, spans: Sequence[tuple[int, int]], index: int, offsets: Iterable[int],
                what: str) -> tuple[int, ...]:
    """The offsets within segment ``index``, checked to be ascending and inside it (:func:`fail` otherwise)."""
    check_index(name, base, spans, index, f"{what} segment")
    seg_offset, seg_nbytes = spans[index]
    values = tuple(int(o) for o in offsets)
    prev = 0
    for i, value in enumerate(values):
        if not prev <= value <= seg_nbytes:
            raise fail(name, base + seg_offset, f"{what} offset [{i}] = {value} is outside "
                        f"[{prev}, {seg_nbytes}] (segment {index}, {seg_nbytes} bytes)")
        prev = value
    return values


def label(labels: dict[int, list[Any]], index: int, label: str, key: str | None = None) -> None:
    """First reference names a segment; named-data keys accumulate on a named segment."""
    entry = labels.setdefault(index, [label, []])
    if key is not None and entry[0] == label:
        entry[1].append(key)


def segments_of(name: str, base: int, spans: Sequence[tuple[int, int]], labels: dict[int, list[Any]], limit: int,
                has_header: bool) -> tuple[Segment, ...]:
    """The :class:`Segment` of each ``(offset, size)`` span, checked to end before ``limit`` and not to overlap."""
    out = []
    for i, (offset, size) in enumerate(spans):
        if offset < 0 or size < 0:
            raise fail(name, base, f"segment {i} has a negative offset or size")
        if size and not has_header:
            raise fail(name, 8, f"segment {i} holds {size} bytes but the file has no extended header")
        start, end = base + offset, base + offset + size
        if end > limit:
            where = "the end of the segment data" if has_header else "the end of the file"
            raise fail(name, start, f"segment {i} [{start}, {end}) ({size} bytes) ends beyond {where} ({limit})")
        label, keys = labels.get(i, ["unreferenced segment", []])
        out.append(Segment(i, offset, size, start, end, label, tuple(keys)))
    filled = sorted((s for s in out if s.nbytes), key=lambda s: s.start)
    for a, b in pairwise(filled):
        if b.start < a.end:
            raise fail(name, b.start,
                       f"segment {b.index} [{b.start}, {b.end}) overlaps segment {a.index} [{a.start}, {a.end})")
    return tuple(out)


def section_map(art: Artifact) -> tuple[Section, ...]:
    """Non-empty sections covering ``[0, art.file_nbytes)`` in order, no overlap."""
    header, fb_end, nbytes = art.header, art.flatbuffer_end, art.file_nbytes
    sections: list[Section] = [Section(0, 8, "flatbuffer")]
    if isinstance(header, ExtendedHeader):
        hdr_end = HEADER_OFFSET + min(header.length, fb_end - HEADER_OFFSET)
        sections.append(Section(8, hdr_end, "extended header"))
        sections.append(Section(hdr_end, fb_end, "flatbuffer"))
    elif isinstance(header, FlatTensorHeader):
        sections.append(Section(8, 8 + header.length, "flat tensor header"))
        sections.append(Section(8 + header.length, 8 + header.flatbuffer_offset, "header padding"))
        sections.append(Section(8 + header.flatbuffer_offset, fb_end, "flatbuffer"))
    else:
        sections.append(Section(8, fb_end, "flatbuffer"))
    pos = fb_end
    for seg in sorted((s for s in art.segments if s.nbytes), key=lambda s: s.start):
        sections.append(Section(pos, seg.start, "padding"))
        sections.append(Section(seg.start, seg.end, seg.label, seg.keys[0] if seg.keys else None))
        pos = seg.end
    data_end = art.segment_base_offset + art.segment_data_nbytes if header is not None else fb_end
    if pos < data_end:
        sections.append(Section(pos, data_end, "padding"))
        pos = data_end
    sections.append(Section(pos, nbytes, "trailing bytes"))
    return tuple(s for s in sections if s.end > s.start)
