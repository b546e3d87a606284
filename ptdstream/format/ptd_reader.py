"""Read a .ptd's metadata: the FlatTensor header and flatbuffer (``flat_tensor.fbs``).

The flatbuffer is checked by :mod:`ptdstream.format.verifier` (the C++
``flatbuffers::Verifier`` rules; the runtime itself does not verify it, see
``fb_roots.flat_tensor_root``) and read with the ``flatc --python`` code of
``flat_tensor_fb/``. Segment payload is never read.
"""

from __future__ import annotations

from typing import Any

from ..errors import FlatbufferError
from .artifact import Artifact, NamedEntry, ReadAt, TensorMeta, check_index, fail, label, segments_of
from .fb_roots import flat_tensor_root, text
from .identity import FlatTensorHeader

__all__ = ["parse_ptd"]


def parse_ptd(name: str, nbytes: int, head: bytes, read_at: ReadAt) -> Artifact:
    """The section map of a ``.ptd`` of ``nbytes`` bytes whose first 64 bytes are ``head``
    (:func:`~ptdstream.format.reader.parse_artifact`)."""
    header = FlatTensorHeader.from_bytes(head[8 : 8 + FlatTensorHeader.LENGTH])
    if header is None:
        raise fail(name, 8, f"no FlatTensor header: expected b'FH01' with length >= {FlatTensorHeader.LENGTH}, "
                    f"found {head[8:12]!r}" + (" (file truncated)" if nbytes < 48 else ""))
    fb_off, fb_size = header.flatbuffer_offset, header.flatbuffer_size
    base, data_nbytes = header.segment_base_offset, header.segment_data_size
    if not header.length <= fb_off <= nbytes:
        raise fail(name, 16, f"flatbuffer_offset {fb_off} is outside [{header.length}, file size {nbytes}]")
    if not 8 <= fb_size <= nbytes - fb_off:
        raise fail(name, 24,
                   f"flatbuffer_size {fb_size} is below 8 or runs beyond the end of the file ({nbytes} bytes)")
    fb_end = fb_off + fb_size
    if not fb_end <= base <= nbytes:
        raise fail(name, 32, f"segment_base_offset {base} is outside [{fb_end}, file size {nbytes}]")
    if data_nbytes > nbytes - base:
        raise fail(name, 40, f"segment_data_size {data_nbytes}: segments [{base}, {base + data_nbytes}) "
                    f"end beyond the end of the file ({nbytes} bytes)")
    try:
        ft = flat_tensor_root(read_at(0, fb_end))
    except FlatbufferError as e:
        raise fail(name, e.offset, f"FlatTensor flatbuffer: {e.what}") from None
    if ft.SegmentsIsNone() or ft.NamedDataIsNone():  # FlatTensorDataMap::load requires both
        raise fail(name, 0, "FlatTensor flatbuffer: segments or named_data is missing (the runtime requires both)")
    spans = [(s.Offset(), s.Size()) for s in map(ft.Segments, range(ft.SegmentsLength()))]
    named = []
    for i in range(ft.NamedDataLength()):
        item = ft.NamedData(i)
        if item.Key() is None:
            raise fail(name, 0, f"FlatTensor flatbuffer: named_data[{i}] has no key")
        lt, layout = item.TensorLayout(), None
        if lt is not None:
            layout = TensorMeta(lt.ScalarType(), tuple(lt.Sizes(j) for j in range(lt.SizesLength())),
                                tuple(lt.DimOrder(j) for j in range(lt.DimOrderLength())))
        named.append(NamedEntry(text(item.Key()), item.SegmentIndex(), layout))
    version = ft.Version()
    labels: dict[int, list[Any]] = {}
    for entry in named:
        check_index(name, base, spans, entry.segment_index, f"named data {entry.key!r}")
        label(labels, entry.segment_index, "named data", entry.key)
    segments = segments_of(name, base, spans, labels, base + data_nbytes, True)
    return Artifact(
        path=name, kind="ptd", file_nbytes=nbytes, identifier=head[4:8].decode("ascii"), header=header,
        flatbuffer_end=fb_end, segment_base_offset=base, segment_data_nbytes=data_nbytes,
        segments=segments, named=tuple(named), version=version,
    )
