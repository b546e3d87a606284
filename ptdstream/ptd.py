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


_INT32_MAX = (1 << 31) - 1


def _check_layouts(named_data: Mapping[str, DataEntry], name: str) -> None:
    """Refuse tensor sizes the schema's ``sizes: [int32]`` cannot hold.

    Upstream passes them to flatc, which fails with "constant does not fit";
    this names the key and the dimension instead.
    """
    from .errors import LayoutError

    for key, entry in named_data.items():
        layout = entry.tensor_layout
        for dim, size in enumerate(getattr(layout, "sizes", None) or ()):
            if not -_INT32_MAX - 1 <= size <= _INT32_MAX:
                raise LayoutError(
                    f"{name}: key {key!r}: dimension {dim} has size {size}, which the "
                    "FlatTensor schema's int32 sizes cannot hold; reshape the tensor so "
                    "every dimension is below 2**31"
                )


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

    _check_layouts(named_data, name)
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
