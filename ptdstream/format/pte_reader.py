"""Read a .pte's metadata: the extended header and the program flatbuffer.

The program flatbuffer is parsed by executorch's own object API through
:mod:`ptdstream.executorch.untrusted` (bounded work, scoped patches); every
segment, constant offset, delegate reference and named-data entry is checked
against the header and the file size. Segment payload is never read.
"""

from __future__ import annotations

from typing import Dict, List

from ..errors import FormatError
from ..executorch.untrusted import parse_program
from .artifact import (
    Artifact,
    NamedEntry,
    ReadAt,
    check_index,
    external_tensors,
    fail,
    label,
    one_line,
    segments_of,
    subsegments,
)
from .identity import HEADER_OFFSET, ExtendedHeader

_SEGMENT_LOCATION = 1  # schema.DataLocation.SEGMENT


def parse_pte(name: str, nbytes: int, head: bytes, read_at: ReadAt) -> Artifact:
    header = None
    program_size, base, data_nbytes = nbytes, 0, 0
    if head[8:12] == ExtendedHeader.MAGIC:
        header = ExtendedHeader.from_bytes(head[8 : 8 + ExtendedHeader.LENGTH])
        if header is None:
            raise fail(name, 8, f"extended header b'eh00' is truncated or its length is < {ExtendedHeader.MINIMUM_LENGTH}")
        program_size, base, data_nbytes = header.program_size, header.segment_base_offset, header.segment_data_size
        used = HEADER_OFFSET + min(header.length, ExtendedHeader.LENGTH)
        if not used <= program_size <= nbytes:
            raise fail(name, 16, f"program_size {program_size} is outside [{used}, file size {nbytes}]")
        if base < program_size and (data_nbytes or base):
            raise fail(name, 24, f"segment_base_offset {base} is inside the program (program_size {program_size})")
        if base > nbytes or data_nbytes > nbytes - base:
            raise fail(name, 32 if base <= nbytes else 24,
                        f"segments [{base}, {base + data_nbytes}) end beyond the end of the file ({nbytes} bytes)")
    if program_size % 4:  # builders finish at a multiple of their alignment (>= 4)
        raise fail(name, 16 if header else nbytes, f"program flatbuffer is {program_size} bytes, not a "
                    "multiple of 4 (truncated?)")
    try:
        program = parse_program(read_at(0, program_size))
    except FormatError:
        raise
    except Exception as e:  # any parse failure of a corrupt flatbuffer
        raise fail(name, 0, f"program flatbuffer ({program_size} bytes) does not parse: {one_line(e)}") from None
    try:
        spans = [(int(s.offset), int(s.size)) for s in program.segments or []]
        limit = base + data_nbytes if header is not None and header.length >= ExtendedHeader.LENGTH else nbytes
        labels: Dict[int, List] = {}
        const_index, const_offsets = None, ()
        cs = program.constant_segment
        if cs is not None and len(cs.offsets) > 0:
            const_index = int(cs.segment_index)
            const_offsets = subsegments(name, base, spans, const_index, cs.offsets, "constant")
            label(labels, const_index, "constant segment")
        for sub in program.mutable_data_segments or []:
            subsegments(name, base, spans, int(sub.segment_index), sub.offsets, "mutable data")
            label(labels, int(sub.segment_index), "mutable data")
        for plan in program.execution_plan or []:
            for d in plan.delegates or []:
                if int(d.processed.location) == _SEGMENT_LOCATION:
                    check_index(name, base, spans, int(d.processed.index), f"delegate {d.id!r}")
                    label(labels, int(d.processed.index), f"delegate blob {d.id}")
        named = []
        for entry in program.named_data or []:
            check_index(name, base, spans, int(entry.segment_index), f"named data {entry.key!r}")
            named.append(NamedEntry(str(entry.key), int(entry.segment_index)))
            label(labels, int(entry.segment_index), "named data", str(entry.key))
        external = external_tensors(program)
        version = int(program.version)
    except (AttributeError, TypeError, ValueError) as e:
        raise fail(name, 0, f"program flatbuffer holds invalid values: {one_line(e)}") from None
    segments = segments_of(name, base, spans, labels, limit, header is not None)
    return Artifact(
        path=name, kind="pte", file_nbytes=nbytes, identifier=head[4:8].decode("ascii"), header=header,
        flatbuffer_end=program_size, segment_base_offset=base, segment_data_nbytes=data_nbytes,
        segments=segments, named=tuple(named), constant_segment_index=const_index,
        constant_offsets=tuple(const_offsets), external_tensors=tuple(external), version=version,
    )
