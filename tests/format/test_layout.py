"""The one layout planner, property-tested against the reference serializers."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
from conftest import Mlp, export
from executorch.exir._serialize._named_data_store import NamedDataStore
from executorch.exir._serialize._program import (
    PTEFile,
    _ExtendedHeader,
    _extract_constant_segment,
    serialize_pte_binary,
)
from executorch.exir._serialize.data_serializer import DataPayload
from executorch.exir.schema import Buffer
from executorch.extension.flat_tensor.serialize.serialize import (
    FlatTensorConfig,
    FlatTensorSerializer,
)
from executorch.extension.flat_tensor.serialize.serialize import (
    FlatTensorHeader as UpstreamFlatTensorHeader,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from ptdstream import BufferRing, StreamingNamedDataStore, plan_ptd, plan_pte, write_plan
from ptdstream.format.identity import ExtendedHeader, FlatTensorHeader
from ptdstream.format.layout import (
    SegmentSpec,
    aligned_size,
    pack_subsegments,
    place_segments,
)
from ptdstream.format.pte import PteOptions
from ptdstream.write.stream_sink import StreamSink

ALIGNMENTS = st.sampled_from([1, 2, 4, 16, 48, 64, 128, 256, 4096])


def plan_bytes(plan) -> bytes:
    out = io.BytesIO()
    write_plan(plan, StreamSink(out), BufferRing(1 << 12, 2))
    data = out.getvalue()
    assert len(data) == plan.nbytes
    return data


def test_constant_segment_example_from_format_doc():
    assert pack_subsegments([0, 60, 12, 28], 16) == ((0, 0, 64, 80), 108)


@given(st.lists(st.integers(0, 300), max_size=12), st.sampled_from([None, 1, 16, 64]))
def test_pack_subsegments_matches_extract_constant_segment(sizes, alignment):
    buffers = [Buffer(storage=bytes(n)) for n in sizes]
    data, offsets = _extract_constant_segment(buffers, tensor_alignment=alignment)
    assert pack_subsegments(sizes, alignment) == (tuple(offsets), len(data))


@given(st.lists(st.tuples(st.integers(0, 5000), ALIGNMENTS), max_size=10), ALIGNMENTS)
def test_place_segments_rule(specs, segment_alignment):
    placements, end = place_segments([SegmentSpec(n, a) for n, a in specs], segment_alignment)
    prev = 0
    for (n, a), p in zip(specs, placements, strict=True):
        assert p.offset >= prev and p.offset % a == 0 and p.offset % segment_alignment == 0
        assert p.offset - prev < math.lcm(a, segment_alignment)  # the smallest gap
        prev = p.offset + n
    assert end == prev


def test_headers_match_upstream_bytes():
    assert ExtendedHeader(1000, 1024, 5 << 32).to_bytes() == _ExtendedHeader(
        program_size=1000, segment_base_offset=1024, segment_data_size=5 << 32
    ).to_bytes()
    assert FlatTensorHeader(48, 300, 384, 7).to_bytes() == UpstreamFlatTensorHeader(
        flatbuffer_offset=48, flatbuffer_size=300, segment_base_offset=384, segment_data_size=7
    ).to_bytes()
    full = ExtendedHeader(10, 20, 0).to_bytes()
    short = full[:4] + (24).to_bytes(4, "little") + full[8:24]
    assert ExtendedHeader.from_bytes(short) == ExtendedHeader(10, 20, 0, length=24)


@pytest.mark.parametrize("cls", [ExtendedHeader, FlatTensorHeader])
def test_both_headers_parse_by_one_rule(cls):
    """MAGIC, u32 length, u64 fields: the full header round-trips; a short buffer, another
    magic or a length under the minimum is no header; a longer length is kept."""
    values = [(i + 1) << (8 * i) for i in range(len(dataclasses.fields(cls)) - 1)]
    full = cls(*values).to_bytes()
    assert len(full) == cls.LENGTH and cls.from_bytes(full) == cls(*values)
    assert cls.from_bytes(full[: cls.MINIMUM_LENGTH - 1]) is None
    assert cls.from_bytes(b"XX00" + full[4:]) is None
    assert cls.from_bytes(full[:4] + (cls.MINIMUM_LENGTH - 1).to_bytes(4, "little") + full[8:]) is None
    longer = cls.from_bytes(full[:4] + (cls.LENGTH + 8).to_bytes(4, "little") + full[8:])
    assert longer == cls(*values, length=cls.LENGTH + 8) and longer.to_bytes() == full


blob_lists = st.lists(
    st.tuples(st.integers(0, 700), ALIGNMENTS, st.integers(0, 3)), min_size=0, max_size=8
)


@settings(max_examples=25, deadline=None)
@given(blob_lists, st.sampled_from([1, 16, 128, 4096]))
def test_ptd_plan_matches_flat_tensor_serializer(blobs, segment_alignment):
    upstream, ours = NamedDataStore(), StreamingNamedDataStore()
    for i, (n, alignment, fill) in enumerate(blobs):
        data = bytes([fill]) * n
        upstream.add_named_data(f"k{i}", data, alignment, external_tag="t")
        ours.add_named_data(f"k{i}", data, alignment, external_tag="t")
    up = upstream.get_named_data_store_output()
    entries = up.external_data.get("t", {})
    ref = FlatTensorSerializer(FlatTensorConfig(segment_alignment=segment_alignment)).serialize(
        DataPayload(buffers=up.buffers, named_data=entries)
    )
    out = ours.get_named_data_store_output()
    plan = plan_ptd(out.buffers, out.external_data.get("t", {}), segment_alignment=segment_alignment)
    assert plan_bytes(plan) == bytes(ref)


@pytest.fixture(scope="module")
def portable_program():
    return export(Mlp()).executorch_program


@settings(max_examples=20, deadline=None)
@given(blob_lists, st.sampled_from([16, 128, 4096]), st.sampled_from([None, 16, 64]))
def test_pte_plan_matches_serialize_pte_binary(portable_program, blobs, segment_alignment, cta):
    upstream, ours = NamedDataStore(), StreamingNamedDataStore()
    for i, (n, alignment, fill) in enumerate(blobs):
        data = bytes([fill + 1]) * n
        upstream.add_named_data(f"k{i}", data, alignment)
        ours.add_named_data(f"k{i}", data, alignment)
    up = upstream.get_named_data_store_output()
    named = up if up.pte_data else None
    ref = serialize_pte_binary(
        PTEFile(program=portable_program, named_data=named),
        extract_delegate_segments=True,
        segment_alignment=segment_alignment,
        constant_tensor_alignment=cta,
    )
    out = ours.get_named_data_store_output()
    plan = plan_pte(
        portable_program,
        named_buffers=out.buffers,
        named_data=out.pte_data if named else None,
        options=PteOptions(True, segment_alignment, cta, None),
    )
    assert plan_bytes(plan) == bytes(ref)


def test_segment_offsets_above_4_gib_are_planned_exactly():
    specs = [SegmentSpec(3 << 30), SegmentSpec(17, 48), SegmentSpec(5 << 30, 16)]
    placements, end = place_segments(specs, 128)
    assert placements[1].offset == aligned_size(3 << 30, 384)
    assert placements[2].offset == aligned_size(placements[1].offset + 17, 128)
    assert end == placements[2].offset + (5 << 30) and end > 1 << 32
