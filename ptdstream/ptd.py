"""Plan a .ptd (FlatTensor): buffers + ``{key: DataEntry}`` -> :class:`~ptdstream.plan.FilePlan`.

Mirrors ``extension/flat_tensor/serialize/serialize.py::FlatTensorSerializer.serialize``
(executorch 1.5.1): one segment per buffer, in key order, the first time a buffer
is named, with that key's alignment; the FlatTensor flatbuffer (``FT01``) is built
from the same JSON with the same bundled flatc as upstream, so its bytes match;
the 40-byte ``FH01`` header (padded to 48) is inserted at byte 8.
"""

from __future__ import annotations

from typing import List, Mapping, Optional, Sequence

from . import _upstream
from .layout import ptd_head
from .plan import FilePlan, SegmentPlan, assemble, place
from .pte import _named_segments
from .sources import Source
from .store import DataEntry

#: ``extension/flat_tensor/serialize/serialize.py::_FLAT_TENSOR_VERSION``.
FLAT_TENSOR_VERSION = 0


def plan_ptd(
    buffers: Sequence[Source],
    named_data: Mapping[str, DataEntry],
    *,
    segment_alignment: int = 128,
    name: str = "data.ptd",
    fingerprints: Optional[Mapping[int, object]] = None,
) -> FilePlan:
    """Plan one FlatTensor data file.

    Args:
        buffers: sources indexed by ``DataEntry.buffer_index``.
        named_data: ``{key: DataEntry}`` in the order upstream iterates it.
        segment_alignment: bytes; every segment starts at a multiple of
            ``lcm(segment_alignment, entry alignment)``.
        name: the file name, for messages and reports.
        fingerprints: digests already known per buffer index (integrity check).
    """
    from executorch.extension.flat_tensor.serialize.flat_tensor_schema import (
        DataSegment,
        FlatTensor,
        NamedData,
    )

    segments: List[SegmentPlan] = []
    keyed = _named_segments(buffers, named_data, segments, fingerprints)
    placements, data_nbytes = place(segments, segment_alignment)
    flat_tensor = FlatTensor(
        version=FLAT_TENSOR_VERSION,
        segments=[DataSegment(offset=p.offset, size=p.nbytes) for p in placements],
        named_data=[
            NamedData(key=key, segment_index=index, tensor_layout=named_data[key].tensor_layout)
            for key, index in keyed
        ],
    )
    flatbuffer = _upstream.flat_tensor_to_flatbuffer(flat_tensor)
    head, base = ptd_head(flatbuffer, data_nbytes, segment_alignment)
    return assemble("ptd", name, head, base, segments, placements, len(flatbuffer))
