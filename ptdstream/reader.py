"""Read a .pte or .ptd back into a section map, trusting no size field.

:func:`read_artifact` reads only the first 64 bytes and the metadata flatbuffer;
segment payload is never read. Every size and offset taken from the file is
checked against the file size (and against the other header fields) before
anything is read or allocated from it, so a header claiming a 2^60-byte segment
fails at once. Anything invalid raises :class:`~ptdstream.errors.FormatError`
with one line naming the file and the offset of the bad field.

The .pte program flatbuffer is parsed by ExecuTorch's own reader (through
:mod:`ptdstream._upstream`); the .ptd FlatTensor flatbuffer by a small reader
over ``flatbuffers.table.Table`` that checks every offset and vector length and
caps the total work at a few times the flatbuffer's size.
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, Union


from . import _upstream
from .errors import FormatError
from .layout import HEADER_OFFSET, ExtendedHeader, FlatTensorHeader

#: Bytes read to find a header (upstream's ``_ExtendedHeader.NUM_HEAD_BYTES``).
HEAD_NBYTES = 64
_IDENT = re.compile(rb"(ET|FT)[0-9a-zA-Z]{2}\Z")
_SEGMENT_LOCATION = 1  # schema.DataLocation.SEGMENT
_EXTERNAL_LOCATION = 1  # schema.TensorDataLocation.EXTERNAL


@dataclass(frozen=True)
class TensorLayout:
    """A tensor's layout: ``scalar_type`` (ExecuTorch ScalarType value), sizes, dim order."""

    scalar_type: int
    sizes: Tuple[int, ...]
    dim_order: Tuple[int, ...]


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
    keys: Tuple[str, ...] = ()


@dataclass(frozen=True)
class NamedEntry:
    """A named-data key, its segment index and (in a .ptd) its tensor layout."""

    key: str
    segment_index: int
    layout: Optional[TensorLayout] = None


@dataclass(frozen=True)
class ExternalTensor:
    """A program tensor whose data lives in a .ptd under ``fqn``."""

    fqn: str
    layout: TensorLayout


@dataclass(frozen=True)
class Section:
    """A byte range ``[start, end)`` of a file, its name and key (or None)."""

    start: int
    end: int
    name: str
    key: Optional[str] = None

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Artifact:
    """What :func:`read_artifact` found. All offsets and sizes are in bytes.

    ``header`` is an :class:`~ptdstream.layout.ExtendedHeader` (None for a .pte
    that is a raw flatbuffer) or a :class:`~ptdstream.layout.FlatTensorHeader`;
    ``flatbuffer_end`` ends the metadata (header included, it starts at 0);
    ``constant_offsets`` are the tensor offsets within the constant segment.
    """

    path: str
    kind: str
    file_nbytes: int
    identifier: str
    header: Union[ExtendedHeader, FlatTensorHeader, None]
    flatbuffer_end: int
    segment_base_offset: int
    segment_data_nbytes: int
    segments: Tuple[Segment, ...]
    named: Tuple[NamedEntry, ...]
    constant_segment_index: Optional[int] = None
    constant_offsets: Tuple[int, ...] = ()
    external_tensors: Tuple[ExternalTensor, ...] = ()
    version: int = 0
    _sections: Tuple[Section, ...] = field(default=(), repr=False, compare=False)

    @property
    def keys(self) -> Dict[str, int]:
        """Named-data key -> segment index."""
        return {e.key: e.segment_index for e in self.named}

    def sections(self) -> Tuple[Section, ...]:
        """Non-empty sections covering ``[0, file_nbytes)`` in order, no overlap."""
        return self._sections

    def locate(self, offset: int) -> Optional[Section]:
        """The section holding file offset ``offset``, None past the end. Inside the
        constant segment the key is ``constant <i>`` (tensor ``i`` of the segment)."""
        if not 0 <= offset < self.file_nbytes or not self._sections:
            return None
        sec = self._sections[bisect.bisect_right([s.start for s in self._sections], offset) - 1]
        if sec.name == "constant segment" and self.constant_offsets:
            i = bisect.bisect_right(self.constant_offsets, offset - sec.start) - 1
            return Section(sec.start, sec.end, sec.name, f"constant {max(i, 0)}")
        return sec


ReadAt = Callable[[int, int], bytes]


def read_artifact(path: str) -> Artifact:
    """Parse the .pte or .ptd at ``path`` (kind from its identifier, not its name).

    Memory: 64 bytes plus the metadata flatbuffer, whose size is checked against
    the file size first. Segment payload is not read.

    Raises:
        FormatError: invalid or truncated file (one line: file, offset, problem).
        OSError: the file cannot be opened or read.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        nbytes = os.fstat(f.fileno()).st_size
        fd = f.fileno()

        def read_at(offset: int, count: int) -> bytes:
            data = os.pread(fd, count, offset)
            if len(data) != count:
                raise FormatError(f"{path}: at offset {offset}: read {len(data)} of {count} bytes (file changed?)")
            return data

        return parse_artifact(path, nbytes, read_at)


def parse_artifact(name: str, nbytes: int, read_at: ReadAt) -> Artifact:
    """Like :func:`read_artifact`, over any random-access source of ``nbytes`` bytes."""
    if nbytes < 8:
        raise _fail(name, 0, f"file is {nbytes} bytes, shorter than a flatbuffer's 8-byte prefix")
    head = read_at(0, min(nbytes, HEAD_NBYTES))
    ident = head[4:8]
    if not _IDENT.match(ident):
        raise _fail(name, 4, f"identifier {ident!r} is neither ET.. (.pte) nor FT.. (.ptd)")
    if ident.startswith(b"ET"):
        return _parse_pte(name, nbytes, head, read_at)
    return _parse_ptd(name, nbytes, head, read_at)


def _fail(name: str, offset: int, what: str) -> FormatError:
    return FormatError(f"{name}: at offset {offset}: {what}")


def _parse_pte(name: str, nbytes: int, head: bytes, read_at: ReadAt) -> Artifact:
    header = None
    program_size, base, data_nbytes = nbytes, 0, 0
    if head[8:12] == ExtendedHeader.MAGIC:
        header = ExtendedHeader.from_bytes(head[8 : 8 + ExtendedHeader.LENGTH])
        if header is None:
            raise _fail(name, 8, f"extended header b'eh00' is truncated or its length is < {ExtendedHeader.MINIMUM_LENGTH}")
        program_size, base, data_nbytes = header.program_size, header.segment_base_offset, header.segment_data_size
        used = HEADER_OFFSET + min(header.length, ExtendedHeader.LENGTH)
        if not used <= program_size <= nbytes:
            raise _fail(name, 16, f"program_size {program_size} is outside [{used}, file size {nbytes}]")
        if base < program_size and (data_nbytes or base):
            raise _fail(name, 24, f"segment_base_offset {base} is inside the program (program_size {program_size})")
        if base > nbytes or data_nbytes > nbytes - base:
            raise _fail(name, 32 if base <= nbytes else 24,
                        f"segments [{base}, {base + data_nbytes}) end beyond the end of the file ({nbytes} bytes)")
    if program_size % 4:  # builders finish at a multiple of their alignment (>= 4)
        raise _fail(name, 16 if header else nbytes, f"program flatbuffer is {program_size} bytes, not a "
                    "multiple of 4 (truncated?)")
    try:
        program = _upstream.flatbuffer_to_program_checked(read_at(0, program_size))
    except FormatError:
        raise
    except Exception as e:  # any parse failure of a corrupt flatbuffer
        raise _fail(name, 0, f"program flatbuffer ({program_size} bytes) does not parse: {_one_line(e)}") from None
    try:
        spans = [(int(s.offset), int(s.size)) for s in program.segments or []]
        limit = base + data_nbytes if header is not None and header.length >= ExtendedHeader.LENGTH else nbytes
        labels: Dict[int, List] = {}
        const_index, const_offsets = None, ()
        cs = program.constant_segment
        if cs is not None and len(cs.offsets) > 0:
            const_index = int(cs.segment_index)
            const_offsets = _subsegments(name, base, spans, const_index, cs.offsets, "constant")
            _label(labels, const_index, "constant segment")
        for sub in program.mutable_data_segments or []:
            _subsegments(name, base, spans, int(sub.segment_index), sub.offsets, "mutable data")
            _label(labels, int(sub.segment_index), "mutable data")
        for plan in program.execution_plan or []:
            for d in plan.delegates or []:
                if int(d.processed.location) == _SEGMENT_LOCATION:
                    _check_index(name, base, spans, int(d.processed.index), f"delegate {d.id!r}")
                    _label(labels, int(d.processed.index), f"delegate blob {d.id}")
        named = []
        for entry in program.named_data or []:
            _check_index(name, base, spans, int(entry.segment_index), f"named data {entry.key!r}")
            named.append(NamedEntry(str(entry.key), int(entry.segment_index)))
            _label(labels, int(entry.segment_index), "named data", str(entry.key))
        external = _external_tensors(program)
        version = int(program.version)
    except (AttributeError, TypeError, ValueError) as e:
        raise _fail(name, 0, f"program flatbuffer holds invalid values: {_one_line(e)}") from None
    segments = _segments(name, base, spans, labels, limit, header is not None)
    return _artifact(name, "pte", nbytes, head, header, program_size, base, data_nbytes, segments,
                     named, const_index, const_offsets, external, version)


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:300]


def _check_index(name: str, base: int, spans, index: int, what: str) -> None:
    if not 0 <= index < len(spans):
        raise _fail(name, base, f"{what} names segment {index}, but there are {len(spans)} segments")


def _subsegments(name, base, spans, index, offsets, what) -> Tuple[int, ...]:
    _check_index(name, base, spans, index, f"{what} segment")
    seg_offset, seg_nbytes = spans[index]
    values = tuple(int(o) for o in offsets)
    prev = 0
    for i, value in enumerate(values):
        if not prev <= value <= seg_nbytes:
            raise _fail(name, base + seg_offset, f"{what} offset [{i}] = {value} is outside "
                        f"[{prev}, {seg_nbytes}] (segment {index}, {seg_nbytes} bytes)")
        prev = value
    return values


def _label(labels: Dict[int, List], index: int, label: str, key: Optional[str] = None) -> None:
    """First reference names a segment; named-data keys accumulate on a named segment."""
    entry = labels.setdefault(index, [label, []])
    if key is not None and entry[0] == label:
        entry[1].append(key)


def _external_tensors(program) -> Tuple[ExternalTensor, ...]:
    found: Dict[str, ExternalTensor] = {}
    for plan in program.execution_plan or []:
        for value in plan.values or []:
            info = getattr(value.val, "extra_tensor_info", None)
            if info is None or int(info.location) != _EXTERNAL_LOCATION or not info.fully_qualified_name:
                continue
            t = value.val
            layout = TensorLayout(int(t.scalar_type), tuple(int(s) for s in t.sizes), tuple(int(d) for d in t.dim_order))
            found.setdefault(str(info.fully_qualified_name), ExternalTensor(str(info.fully_qualified_name), layout))
    return tuple(found.values())


def _segments(name, base, spans, labels, limit, has_header) -> Tuple[Segment, ...]:
    out = []
    for i, (offset, size) in enumerate(spans):
        if offset < 0 or size < 0:
            raise _fail(name, base, f"segment {i} has a negative offset or size")
        if size and not has_header:
            raise _fail(name, 8, f"segment {i} holds {size} bytes but the file has no extended header")
        start, end = base + offset, base + offset + size
        if end > limit:
            where = "the end of the segment data" if has_header else "the end of the file"
            raise _fail(name, start, f"segment {i} [{start}, {end}) ({size} bytes) ends beyond {where} ({limit})")
        label, keys = labels.get(i, ["unreferenced segment", []])
        out.append(Segment(i, offset, size, start, end, label, tuple(keys)))
    filled = sorted((s for s in out if s.nbytes), key=lambda s: s.start)
    for a, b in zip(filled, filled[1:]):
        if b.start < a.end:
            raise _fail(name, b.start, f"segment {b.index} [{b.start}, {b.end}) overlaps segment {a.index} [{a.start}, {a.end})")
    return tuple(out)


def _artifact(name, kind, nbytes, head, header, fb_end, base, data_nbytes, segments, named,
              const_index=None, const_offsets=(), external=(), version=0) -> Artifact:
    sections: List[Section] = [Section(0, 8, "flatbuffer")]
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
    for seg in sorted((s for s in segments if s.nbytes), key=lambda s: s.start):
        sections.append(Section(pos, seg.start, "padding"))
        sections.append(Section(seg.start, seg.end, seg.label, seg.keys[0] if seg.keys else None))
        pos = seg.end
    data_end = base + data_nbytes if header is not None else fb_end
    if pos < data_end:
        sections.append(Section(pos, data_end, "padding"))
        pos = data_end
    sections.append(Section(pos, nbytes, "trailing bytes"))
    return Artifact(
        path=name, kind=kind, file_nbytes=nbytes, identifier=head[4:8].decode("ascii"), header=header,
        flatbuffer_end=fb_end, segment_base_offset=base, segment_data_nbytes=data_nbytes,
        segments=segments, named=tuple(named), constant_segment_index=const_index,
        constant_offsets=tuple(const_offsets), external_tensors=tuple(external), version=version,
        _sections=tuple(s for s in sections if s.end > s.start),
    )


def _parse_ptd(name: str, nbytes: int, head: bytes, read_at: ReadAt) -> Artifact:
    header = FlatTensorHeader.from_bytes(head[8 : 8 + FlatTensorHeader.LENGTH])
    if header is None:
        raise _fail(name, 8, f"no FlatTensor header: expected b'FH01' with length >= {FlatTensorHeader.LENGTH}, "
                    f"found {head[8:12]!r}" + (" (file truncated)" if nbytes < 48 else ""))
    fb_off, fb_size = header.flatbuffer_offset, header.flatbuffer_size
    base, data_nbytes = header.segment_base_offset, header.segment_data_size
    if not header.length <= fb_off <= nbytes:
        raise _fail(name, 16, f"flatbuffer_offset {fb_off} is outside [{header.length}, file size {nbytes}]")
    if not 8 <= fb_size <= nbytes - fb_off:
        raise _fail(name, 24, f"flatbuffer_size {fb_size} is below 8 or runs beyond the end of the file ({nbytes} bytes)")
    fb_end = fb_off + fb_size
    if not fb_end <= base <= nbytes:
        raise _fail(name, 32, f"segment_base_offset {base} is outside [{fb_end}, file size {nbytes}]")
    if data_nbytes > nbytes - base:
        raise _fail(name, 40, f"segment_data_size {data_nbytes}: segments [{base}, {base + data_nbytes}) "
                    f"end beyond the end of the file ({nbytes} bytes)")
    from .flat_tensor_reader import FlatTensorReader

    version, spans, named = FlatTensorReader(read_at(0, fb_end), name).read()
    labels: Dict[int, List] = {}
    for entry in named:
        _check_index(name, base, spans, entry.segment_index, f"named data {entry.key!r}")
        _label(labels, entry.segment_index, "named data", entry.key)
    segments = _segments(name, base, spans, labels, base + data_nbytes, True)
    return _artifact(name, "ptd", nbytes, head, header, fb_end, base, data_nbytes, segments,
                     named, version=version)
