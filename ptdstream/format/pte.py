"""Plan a .pte: program + mutable data + named data -> :class:`~ptdstream.format.plan.FilePlan`.

Mirrors ``exir/_serialize/_program.py::serialize_pte_binary`` (executorch 1.5.1)
without copying payload: constants, mutable buffers, delegate blobs and named
data stay where they are (as sources) and only a metadata-only copy of the
program is serialized, with executorch's own Python flatbuffer builder.

Segment order: (1) the constant segment whenever ``constant_buffer`` is
non-empty (each tensor padded to ``constant_tensor_alignment`` except the last);
(2) the mutable-data segment when it holds any byte (no padding); (3) when
extracting, one segment per distinct non-empty inline delegate blob (alignment
1), empty blobs staying inline; (4) named data, one segment per buffer in key
order, with the first key's alignment.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..sources import BufferRing, Source, as_source
from ..sources.fingerprint import CandidateKey, candidate_key
from ..upstream import adapter
from .layout import pack_subsegments, padding_required, pte_head
from .plan import DataEntry, Extent, FilePlan, SegmentPlan, assemble, named_segments, place

__all__ = ["PteOptions", "plan_pte"]

#: ``exir/tensor.py::ALIGNMENT``: the default constant tensor alignment.
DEFAULT_TENSOR_ALIGNMENT = 16


@dataclass(frozen=True)
class PteOptions:
    """Layout parameters of ``serialize_pte_binary`` (and ``ExecutorchBackendConfig``).

    Attributes:
        extract_delegate_segments: move inline delegate blobs to segments.
        segment_alignment: bytes; each segment starts at a multiple of it (128).
        constant_tensor_alignment: bytes, power of two; None means 16.
        delegate_alignment: bytes, power of two; None keeps the schema's 16.
    """

    extract_delegate_segments: bool = True
    segment_alignment: int = 128
    constant_tensor_alignment: int | None = None
    delegate_alignment: int | None = None

    @staticmethod
    def from_backend_config(config: Any) -> PteOptions:
        """Take the four fields from an ``ExecutorchBackendConfig``."""
        return PteOptions(
            extract_delegate_segments=config.extract_delegate_segments,
            segment_alignment=config.segment_alignment,
            constant_tensor_alignment=config.constant_tensor_alignment,
            delegate_alignment=config.delegate_alignment,
        )


def _packed_segment(
    buffers: Sequence[Any], alignment: int | None, label: str
) -> tuple[tuple[Extent, ...], list[int], int]:
    """Parts and offsets of tensors packed in one segment (constant or mutable)."""
    sizes = [len(b.storage) for b in buffers]
    offsets, total = pack_subsegments(sizes, alignment)
    parts: list[Extent] = []
    for i, buf in enumerate(buffers):
        if sizes[i]:
            parts.append(
                Extent.payload(as_source(buf.storage, f"{label} {i}"), label, (f"{label} {i}",))
            )
        if i < len(buffers) - 1 and alignment is not None:
            pad = padding_required(sizes[i], alignment)
            if pad:
                parts.append(Extent.zeros(pad, label))
    return tuple(parts), list(offsets), total


def _extract_delegates(program: Any, segments: list[SegmentPlan]) -> None:
    """Move non-empty inline delegate blobs into segments, deduplicated by content.

    Modifies the metadata ``program`` in place exactly as upstream's
    ``_extract_delegate_segments`` does, with the same errors.
    """
    from executorch.exir.schema import BackendDelegateDataReference, DataLocation

    remaining: list[Any] = []
    seen: set[int] = set()
    by_candidate: dict[CandidateKey, list[tuple[Source, int]]] = {}
    for plan in program.execution_plan:
        for delegate in plan.delegates:
            if delegate.processed.location != DataLocation.INLINE:
                raise ValueError(
                    "Program must only contain inline delegate data, "
                    + f"saw {repr(delegate)}"
                )
            try:
                inline = program.backend_delegate_data[delegate.processed.index]
            except IndexError:
                raise ValueError(
                    f"Delegate processed index {delegate.processed.index} "
                    + ">= len(Program.backend_delegate_data) "
                    + f"{len(program.backend_delegate_data)} "
                    + f"in {repr(delegate)}"
                ) from None
            seen.add(delegate.processed.index)
            if inline.data:
                source = as_source(inline.data, label=f"delegate {delegate.id}")
                index = _find_equal(by_candidate, source)
                if index is None:
                    index = len(segments)
                    label = f"delegate blob {delegate.id}"
                    segments.append(
                        SegmentPlan((Extent.payload(source, label, (label,)),), 1, label)
                    )
                    by_candidate.setdefault(candidate_key(source), []).append((source, index))
                delegate.processed = BackendDelegateDataReference(
                    location=DataLocation.SEGMENT, index=index
                )
            else:
                new_index = len(remaining)
                remaining.append(inline)
                delegate.processed.index = new_index
    unvisited = set(range(len(program.backend_delegate_data))).difference(seen)
    if unvisited:
        raise ValueError(
            "Did not handle all elements of backend_delegate_data; "
            + f"remaining: {unvisited}"
        )
    program.backend_delegate_data = remaining


def _find_equal(by_candidate: dict[CandidateKey, list[tuple[Source, int]]], source: Source) -> int | None:
    """Index of an earlier delegate blob with the same bytes (exact comparison)."""
    for other, index in by_candidate.get(candidate_key(source), ()):
        if other is source or _same_bytes(other, source):
            return index
    return None


def _same_bytes(a: Source, b: Source) -> bool:
    ring_a, ring_b = BufferRing(count=1), BufferRing(count=1)
    for x, y in zip(a.pieces(ring_a), b.pieces(ring_b), strict=False):  # equal nbytes: the candidate key
        if x != y:
            return False
    return True


def plan_pte(
    program: Any,
    *,
    mutable_data: Sequence[Any] | None = None,
    named_buffers: Sequence[Source] = (),
    named_data: Mapping[str, DataEntry] | None = None,
    options: PteOptions = PteOptions(),
    name: str = "model.pte",
) -> FilePlan:
    """Plan the .pte for ``program`` (an ``executorch.exir.schema.Program``, not modified).

    Args:
        program: the emitter's program; constants may still be inline.
        mutable_data: the emitter's ``mutable_data`` (``List[Buffer]``) or None.
        named_buffers: the store's buffers (sources) that ``named_data`` indexes.
        named_data: ``{key: DataEntry}`` to place in the .pte, or None.
        options: layout parameters.
        name: the file name, for messages and reports.

    Raises:
        ValueError: upstream's errors (non-inline delegate data, a bad delegate
            index, a program that already has named data, a bad alignment).
    """
    from executorch.exir.schema import DataSegment, NamedData, SubsegmentOffsets

    cta = options.constant_tensor_alignment or DEFAULT_TENSOR_ALIGNMENT
    meta = copy.copy(program)
    # Deep-copy the metadata only: bytes are shared, never copied, by deepcopy.
    meta.execution_plan = copy.deepcopy(program.execution_plan)
    meta.backend_delegate_data = copy.deepcopy(program.backend_delegate_data)
    meta.segments = []
    segments: list[SegmentPlan] = []

    if len(program.constant_buffer) > 0:
        parts, offsets, _ = _packed_segment(program.constant_buffer, cta, "constant segment")
        meta.constant_segment = SubsegmentOffsets(segment_index=len(segments), offsets=offsets)
        meta.constant_buffer = []
        segments.append(SegmentPlan(parts, 1, "constant segment"))

    if mutable_data is not None:
        parts, offsets, total = _packed_segment(mutable_data, None, "mutable data")
        if total > 0:
            meta.mutable_data_segments = [
                SubsegmentOffsets(segment_index=len(segments), offsets=offsets)
            ]
            segments.append(SegmentPlan(parts, 1, "mutable data"))

    if options.extract_delegate_segments:
        _extract_delegates(meta, segments)

    if named_data is not None:
        if program.named_data is not None and len(program.named_data) > 0:
            raise ValueError("Program already has named data.")
        segments_named = named_segments(named_buffers, named_data, segments)
        meta.named_data = [NamedData(key=k, segment_index=i) for k, i in segments_named]

    placements, data_nbytes = place(segments, options.segment_alignment)
    meta.segments = [DataSegment(offset=p.offset, size=p.nbytes) for p in placements]
    flatbuffer, max_alignment = adapter.program_to_flatbuffer(
        meta, cta, options.delegate_alignment
    )
    head, base = pte_head(flatbuffer, max_alignment, data_nbytes, options.segment_alignment)
    return assemble("pte", name, head, base, segments, placements, len(flatbuffer))
