"""Read a .pte's metadata: the extended header and the program flatbuffer.

The program flatbuffer is first checked by :mod:`ptdstream.format.verifier` (the
C++ ``flatbuffers::Verifier`` rules the runtime applies, work linear in its size),
then read with the ``flatc --python`` code of ``program_fb/`` (torch and executorch
are not imported); every segment, constant offset, delegate reference and
named-data entry is checked against the header and the file size. Segment payload
is never read.
"""

from __future__ import annotations

from typing import Any

from ..errors import FlatbufferError
from .artifact import (
    Artifact,
    ExternalTensor,
    NamedEntry,
    ReadAt,
    TensorMeta,
    check_index,
    fail,
    label,
    segments_of,
    subsegments,
)
from .fb_roots import program_root, text, union_tensor
from .identity import HEADER_OFFSET, ExtendedHeader

__all__ = ["parse_pte"]

_SEGMENT_LOCATION = 1  # schema.DataLocation.SEGMENT
_EXTERNAL_LOCATION = 1  # schema.TensorDataLocation.EXTERNAL
_TENSOR_TYPE = 5  # schema.KernelTypes.Tensor


def parse_pte(name: str, nbytes: int, head: bytes, read_at: ReadAt) -> Artifact:
    """The section map of a ``.pte`` of ``nbytes`` bytes whose first 64 bytes are ``head``
    (:func:`~ptdstream.format.reader.parse_artifact`)."""
    header = None
    program_size, base, data_nbytes = nbytes, 0, 0
    if head[8:12] == ExtendedHeader.MAGIC:
        header = ExtendedHeader.from_bytes(head[8 : 8 + ExtendedHeader.LENGTH])
        if header is None:
            raise fail(name, 8,
                       f"extended header b'eh00' is truncated or its length is < {ExtendedHeader.MINIMUM_LENGTH}")
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
        program = program_root(read_at(0, program_size))
    except FlatbufferError as e:
        raise fail(name, e.offset, f"program flatbuffer ({program_size} bytes) fails the runtime's "
                   f"flatbuffer verification: {e.what}") from None
    spans = [(s.Offset(), s.Size()) for s in map(program.Segments, range(program.SegmentsLength()))]
    limit = base + data_nbytes if header is not None and header.length >= ExtendedHeader.LENGTH else nbytes
    labels: dict[int, list[Any]] = {}
    const_index: int | None = None
    const_offsets: tuple[int, ...] = ()
    cs = program.ConstantSegment()
    if cs is not None and cs.OffsetsLength() > 0:
        const_index = cs.SegmentIndex()
        const_offsets = subsegments(name, base, spans, const_index, _offsets(cs), "constant")
        label(labels, const_index, "constant segment")
    for sub in map(program.MutableDataSegments, range(program.MutableDataSegmentsLength())):
        subsegments(name, base, spans, sub.SegmentIndex(), _offsets(sub), "mutable data")
        label(labels, sub.SegmentIndex(), "mutable data")
    delegates = []
    for plan in map(program.ExecutionPlan, range(program.ExecutionPlanLength())):
        for d in map(plan.Delegates, range(plan.DelegatesLength())):
            delegates.append((text(plan.Name()), text(d.Id())))
            ref = d.Processed()
            if ref is not None and ref.Location() == _SEGMENT_LOCATION:
                check_index(name, base, spans, ref.Index(), f"delegate {text(d.Id())!r}")
                label(labels, ref.Index(), f"delegate blob {text(d.Id())}")
    named = []
    for entry in map(program.NamedData, range(program.NamedDataLength())):
        key = text(entry.Key())
        check_index(name, base, spans, entry.SegmentIndex(), f"named data {key!r}")
        named.append(NamedEntry(key, entry.SegmentIndex()))
        label(labels, entry.SegmentIndex(), "named data", key)
    external = _external_tensors(program)
    version = program.Version()
    segments = segments_of(name, base, spans, labels, limit, header is not None)
    return Artifact(
        path=name, kind="pte", file_nbytes=nbytes, identifier=head[4:8].decode("ascii"), header=header,
        flatbuffer_end=program_size, segment_base_offset=base, segment_data_nbytes=data_nbytes,
        segments=segments, named=tuple(named), constant_segment_index=const_index,
        constant_offsets=tuple(const_offsets), external_tensors=tuple(external), version=version,
        delegates=tuple(delegates),
    )


def _offsets(sub: Any) -> tuple[int, ...]:
    return tuple(sub.Offsets(j) for j in range(sub.OffsetsLength()))


def _external_tensors(program: Any) -> tuple[ExternalTensor, ...]:
    """Tensors the program marks EXTERNAL, by fully qualified name (first one wins)."""
    found: dict[str, ExternalTensor] = {}
    for plan in map(program.ExecutionPlan, range(program.ExecutionPlanLength())):
        for value in map(plan.Values, range(plan.ValuesLength())):
            if value.ValType() != _TENSOR_TYPE or value.Val() is None:
                continue
            t = union_tensor(value)
            info = t.ExtraTensorInfo()
            if info is None or info.Location() != _EXTERNAL_LOCATION or not info.FullyQualifiedName():
                continue
            fqn = text(info.FullyQualifiedName())
            layout = TensorMeta(t.ScalarType(), tuple(t.Sizes(j) for j in range(t.SizesLength())),
                                tuple(t.DimOrder(j) for j in range(t.DimOrderLength())))
            found.setdefault(fqn, ExternalTensor(fqn, layout, t.DataBufferIdx()))
    return tuple(found.values())
