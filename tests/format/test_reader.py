"""ptdstream.reader: section maps of real exports, and corrupt files that must fail fast."""

from __future__ import annotations

import hashlib
import os
import struct
import time
import tracemalloc
from itertools import pairwise

import pytest
from _small_exports import assert_only, param_bytes, patched, truncated, write_reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ptdstream
from ptdstream.errors import FormatError
from ptdstream.format.artifact import TensorMeta as TensorLayout
from ptdstream.format.identity import ExtendedHeader, FlatTensorHeader
from ptdstream.format.reader import read_artifact

FLOAT = 6  # ScalarType.FLOAT


def _contiguous(art) -> None:
    sections = art.sections()
    assert sections[0].start == 0 and sections[-1].end == art.file_nbytes
    for a, b in pairwise(sections):
        assert a.end == b.start
    assert all(s.nbytes > 0 for s in sections)
    assert sum(s.nbytes for s in sections) == art.file_nbytes


def test_constant_segment_pte_header_offsets_and_sections(tmp_path):
    path = write_reference("plain", tmp_path)["model.pte"]
    art = read_artifact(path)
    assert (art.kind, art.identifier, art.file_nbytes) == ("pte", "ET12", 2380)
    assert art.header == ExtendedHeader(program_size=2152, segment_base_offset=2176, segment_data_size=204)
    assert art.flatbuffer_end == 2152
    assert [(s.label, s.offset, s.nbytes, s.start, s.end) for s in art.segments] == [
        ("constant segment", 0, 204, 2176, 2380)
    ]
    # Entry 0 is the empty placeholder; 128, 16, 48 and 12 bytes padded to 16.
    assert art.constant_offsets == (0, 0, 128, 144, 192)
    assert [(s.start, s.end, s.name) for s in art.sections()] == [
        (0, 8, "flatbuffer"),
        (8, 40, "extended header"),
        (40, 2152, "flatbuffer"),
        (2152, 2176, "padding"),
        (2176, 2380, "constant segment"),
    ]
    assert art.locate(2176 + 130).key == "constant 2"
    assert art.locate(2379).key == "constant 4"
    assert art.locate(20).name == "extended header"
    assert art.locate(2380) is None
    with open(path, "rb") as f:
        f.seek(2176)
        assert f.read(128) == param_bytes("plain", "a.weight")
    assert_only(tmp_path, ["model.pte"])


def test_mutable_data_segment_is_labelled(tmp_path):
    art = read_artifact(write_reference("mutable", tmp_path)["model.pte"])
    assert [(s.label, s.offset, s.nbytes) for s in art.segments] == [
        ("constant segment", 0, 88),
        ("mutable data", 128, 16),
    ]
    assert art.segments[1].start == art.segment_base_offset + 128 == 2560
    _contiguous(art)
    with open(art.path, "rb") as f:
        f.seek(2560)
        assert struct.unpack("<4f", f.read(16)) == (0.0, 1.0, 2.0, 3.0)
    assert_only(tmp_path, ["model.pte"])


def test_delegate_blob_and_named_data_keys_are_sha256_of_their_segment(tmp_path):
    art = read_artifact(write_reference("xnnpack", tmp_path)["model.pte"])
    labels = [s.label for s in art.segments]
    assert labels == ["constant segment", "delegate blob XnnpackBackend"] + ["named data"] * 4
    assert art.segments[0].nbytes == 0 and art.segments[1].nbytes == 1184
    assert [e.segment_index for e in art.named] == [2, 3, 4, 5]
    with open(art.path, "rb") as f:
        for entry in art.named:
            seg = art.segments[entry.segment_index]
            f.seek(seg.start)
            data = f.read(seg.nbytes)
            assert entry.key == hashlib.sha256(data).hexdigest()
            assert seg.keys == (entry.key,)
            assert art.locate(seg.start).key == entry.key
    assert param_bytes("xnnpack", "a.weight") == _segment(art, 2)
    _contiguous(art)


def _segment(art, index: int) -> bytes:
    seg = art.segments[index]
    with open(art.path, "rb") as f:
        f.seek(seg.start)
        return f.read(seg.nbytes)


def test_external_constants_pte_is_raw_flatbuffer_and_ptd_has_layouts(tmp_path):
    files = write_reference("external", tmp_path)
    pte = read_artifact(files["model.pte"])
    assert pte.header is None and pte.segment_base_offset == 0
    assert [(s.start, s.end, s.name) for s in pte.sections()] == [(0, 8, "flatbuffer"), (8, 2216, "flatbuffer")]
    assert [(t.fqn, t.layout) for t in pte.external_tensors] == [
        ("a.weight", TensorLayout(FLOAT, (4, 8), (0, 1))),
        ("a.bias", TensorLayout(FLOAT, (4,), (0,))),
        ("b.weight", TensorLayout(FLOAT, (3, 4), (0, 1))),
        ("b.bias", TensorLayout(FLOAT, (3,), (0,))),
    ]
    ptd = read_artifact(files["_default_external_constant.ptd"])
    assert (ptd.kind, ptd.identifier, ptd.version) == ("ptd", "FT01", 0)
    assert ptd.header == FlatTensorHeader(48, 456, 512, 396)
    assert ptd.keys == {"a.weight": 0, "a.bias": 1, "b.weight": 2, "b.bias": 3}
    assert [(s.offset, s.nbytes) for s in ptd.segments] == [(0, 128), (128, 16), (256, 48), (384, 12)]
    assert {e.key: e.layout for e in ptd.named} == {t.fqn: t.layout for t in pte.external_tensors}
    for i, name in enumerate(["a.weight", "a.bias", "b.weight", "b.bias"]):
        assert _segment(ptd, i) == param_bytes("external", name)
    assert [s.name for s in ptd.sections()][:5] == [
        "flatbuffer", "flat tensor header", "header padding", "flatbuffer", "padding"
    ]
    _contiguous(ptd)
    assert_only(tmp_path, ["model.pte", "_default_external_constant.ptd"])


def test_ptd_parser_agrees_with_upstream_deserializer(tmp_path):
    from executorch.exir._serialize._cord import Cord
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    for kind, name in [("external", "_default_external_constant.ptd"), ("xnnpack_ptd", "model.ptd")]:
        path = write_reference(kind, tmp_path / kind)[name]
        with open(path, "rb") as f:
            payload = FlatTensorSerializer().deserialize(Cord(f.read()))
        art = read_artifact(path)
        assert list(art.keys) == list(payload.named_data)
        for entry in art.named:
            want = payload.named_data[entry.key].tensor_layout
            got = entry.layout
            if want is None:
                assert got is None
            else:
                assert got == TensorLayout(int(want.scalar_type), tuple(want.sizes), tuple(want.dim_order))
            buffer_index = payload.named_data[entry.key].buffer_index
            assert _segment(art, entry.segment_index) == bytes(payload.buffers[buffer_index])


def test_ptdstream_save_output_reads_like_upstream(tmp_path):
    from _small_exports import manager

    ref = write_reference("xnnpack_ptd", tmp_path / "ref")
    (tmp_path / "out").mkdir()
    ptdstream.save(manager("xnnpack_ptd"), str(tmp_path / "out" / "model.pte"))
    for name in ("model.pte", "model.ptd"):
        a, b = read_artifact(tmp_path / "out" / name), read_artifact(ref[name])
        assert a.sections() == b.sections() and a.segments == b.segments and a.named == b.named
    assert_only(tmp_path / "out", ["model.pte", "model.ptd"])


def test_pte_with_24_byte_extended_header_is_accepted(tmp_path):
    path = patched(write_reference("plain", tmp_path)["model.pte"], 12, struct.pack("<I", 24))
    art = read_artifact(path)
    assert art.header.length == 24 and art.header.segment_data_size == 0
    assert art.segments[0].end == 2380
    assert [(s.start, s.end, s.name) for s in art.sections()][:3] == [
        (0, 8, "flatbuffer"), (8, 32, "extended header"), (32, 2152, "flatbuffer")
    ]


@pytest.mark.parametrize(
    "kind,name,offset,field",
    [
        ("plain", "model.pte", 32, "segment_data_size"),
        ("plain", "model.pte", 24, "segment_base_offset"),
        ("plain", "model.pte", 16, "program_size"),
        ("external", "_default_external_constant.ptd", 40, "segment_data_size"),
        ("external", "_default_external_constant.ptd", 32, "segment_base_offset"),
        ("external", "_default_external_constant.ptd", 24, "flatbuffer_size"),
    ],
)
def test_header_claiming_2_pow_60_bytes_fails_fast_without_allocating(tmp_path, kind, name, offset, field):
    path = patched(write_reference(kind, tmp_path)[name], offset, struct.pack("<Q", 1 << 60))
    tracemalloc.start()
    start = time.process_time()  # CPU seconds: the work done, not the machine's load
    with pytest.raises(FormatError) as info:
        read_artifact(path)
    seconds = time.process_time() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    message = str(info.value)
    assert message.startswith(f"{path}: at offset {offset}: ") and "\n" not in message
    assert seconds < 0.5 and peak < (1 << 20)


def test_segment_beyond_segment_data_is_rejected(tmp_path):
    path = patched(write_reference("plain", tmp_path)["model.pte"], 32, struct.pack("<Q", 100))
    with pytest.raises(FormatError, match=r"at offset 2176: segment 0 \[2176, 2380\) \(204 bytes\) ends beyond "
                                          r"the end of the segment data \(2276\)"):
        read_artifact(path)
    ptd = write_reference("external", tmp_path / "e")["_default_external_constant.ptd"]
    patched(ptd, 40, struct.pack("<Q", 395))
    with pytest.raises(FormatError, match=r"at offset 896: segment 3 \[896, 908\)"):
        read_artifact(ptd)


@pytest.mark.parametrize("kind,name", [("plain", "model.pte"), ("xnnpack", "model.pte"),
                                       ("external", "_default_external_constant.ptd"),
                                       ("external", "model.pte")])
def test_every_truncation_raises_format_error_naming_the_file(tmp_path, kind, name):
    src = write_reference(kind, tmp_path / "ref")[name]
    size = os.path.getsize(src)
    out = tmp_path / "cut"
    for nbytes in sorted(set(range(0, 80)) | set(range(80, size, 97)) | {size - 1}):
        truncated(src, nbytes, out)
        with pytest.raises(FormatError) as info:
            read_artifact(out)
        assert str(info.value).startswith(f"{out}: at offset ") and "\n" not in str(info.value)
    assert_only(tmp_path, ["ref", "cut"])


def test_bad_magic_and_short_files(tmp_path):
    pte = write_reference("plain", tmp_path / "p")["model.pte"]
    with pytest.raises(FormatError, match=r"at offset 4: identifier b'XX12'"):
        read_artifact(patched(pte, 4, b"XX12", out=tmp_path / "a.pte"))
    with pytest.raises(FormatError, match=r"at offset 8: extended header b'eh00' is truncated or its length is < 24"):
        read_artifact(patched(pte, 12, struct.pack("<I", 16), out=tmp_path / "b.pte"))
    ptd = write_reference("external", tmp_path / "e")["_default_external_constant.ptd"]
    with pytest.raises(FormatError, match=r"at offset 8: no FlatTensor header: expected b'FH01'"):
        read_artifact(patched(ptd, 8, b"FH02", out=tmp_path / "c.ptd"))
    empty = tmp_path / "empty.pte"
    empty.write_bytes(b"")
    with pytest.raises(FormatError, match=r"at offset 0: file is 0 bytes"):
        read_artifact(empty)
    text = tmp_path / "notes.ptd"
    text.write_text("hello world, not a flatbuffer")
    with pytest.raises(FormatError, match=r"at offset 4: identifier b'o wo'"):
        read_artifact(text)


def test_missing_file_raises_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_artifact(tmp_path / "absent.pte")
    assert_only(tmp_path, [])


@pytest.mark.parametrize("kind,name", [("xnnpack", "model.pte"), ("external", "_default_external_constant.ptd"),
                                       ("xnnpack_ptd", "model.ptd")])
def test_each_flatbuffer_word_set_to_huge_value_fails_cleanly(tmp_path, kind, name):
    """Every u32 of the metadata set to 0xFFFFFFF0 in turn: parse or FormatError, fast."""
    src = write_reference(kind, tmp_path / "ref")[name]
    end = read_artifact(src).flatbuffer_end
    out = tmp_path / "bad"
    start = time.perf_counter()
    rejected = 0
    for offset in range(0, end - 3, 4):
        patched(src, offset, struct.pack("<I", 0xFFFFFFF0), out=out)
        try:
            read_artifact(out)
        except FormatError as e:
            assert "\n" not in str(e)
            rejected += 1
    assert rejected > end // 16
    assert time.perf_counter() - start < 30


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_corruption_of_metadata_is_format_error_or_valid(tmp_path, data):
    kind, name = data.draw(st.sampled_from([("plain", "model.pte"), ("xnnpack_ptd", "model.ptd")]))
    src = write_reference(kind, tmp_path / kind)[name]
    end = read_artifact(src).flatbuffer_end
    out = tmp_path / "fuzz"
    for _ in range(data.draw(st.integers(1, 4))):
        offset = data.draw(st.integers(0, end - 1))
        patched(src if not out.exists() else out, offset, bytes([data.draw(st.integers(0, 255))]), out=out)
    try:
        art = read_artifact(out)
    except FormatError as e:
        assert "\n" not in str(e)
    else:
        _contiguous(art)
        for seg in art.segments:
            assert seg.end <= art.file_nbytes
    out.unlink()


def _upstream_ptd(path, buffers, entries):
    from executorch.exir._serialize.data_serializer import DataEntry, DataPayload
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    named = {key: DataEntry(index, alignment, None) for key, (index, alignment) in entries.items()}
    cord = FlatTensorSerializer().serialize(DataPayload(buffers=buffers, named_data=named))
    with open(path, "wb") as f:
        cord.write_to_file(f)
    return read_artifact(path)


def test_empty_ptd_has_no_segments(tmp_path):
    art = _upstream_ptd(tmp_path / "empty.ptd", [], {})
    assert art.segments == () and art.named == () and art.segment_data_nbytes == 0
    assert art.file_nbytes == art.segment_base_offset == 128
    assert [s.name for s in art.sections()] == [
        "flatbuffer", "flat tensor header", "header padding", "flatbuffer", "padding"]
    _contiguous(art)
    assert_only(tmp_path, ["empty.ptd"])


def test_ptd_keys_sharing_a_segment_and_lcm_alignment(tmp_path):
    art = _upstream_ptd(tmp_path / "shared.ptd", [b"x" * 10, b"y" * 20], {"a": (0, 1), "b": (1, 48), "c": (0, 1)})
    assert art.keys == {"a": 0, "b": 1, "c": 0}
    assert [(s.offset, s.nbytes, s.keys) for s in art.segments] == [(0, 10, ("a", "c")), (384, 20, ("b",))]
    assert art.locate(art.segment_base_offset).key == "a"
    assert art.locate(art.segment_base_offset + 384).key == "b"
    _contiguous(art)


def test_overlapping_segments_are_rejected(tmp_path):
    path = write_reference("external", tmp_path)["_default_external_constant.ptd"]
    data = open(path, "rb").read()
    at = data.find(struct.pack("<Q", 384))  # segment 3's offset field (unique in the metadata)
    assert 0 < at < 504 and data.find(struct.pack("<Q", 384), at + 1) == -1
    patched(path, at, struct.pack("<Q", 300))
    with pytest.raises(FormatError, match=r"at offset 812: segment 3 \[812, 824\) overlaps segment 2 \[768, 816\)"):
        read_artifact(path)
    patched(path, at, struct.pack("<Q", 1 << 62))
    with pytest.raises(FormatError,
                       match=r"segment 3 \[\d+, \d+\) \(12 bytes\) ends beyond the end of the segment data \(908\)"):
        read_artifact(path)


def _shared_offsets_pte(fanout: int) -> bytes:
    """A small program whose plans and values all point at one shared table: a
    naive unpacker builds fanout**2 objects from a file of ~8 * fanout bytes."""
    import flatbuffers
    from executorch.exir._serialize.generated.executorch_flatbuffer import (
        EValue as EV,
    )
    from executorch.exir._serialize.generated.executorch_flatbuffer import (
        ExecutionPlan as EP,
    )
    from executorch.exir._serialize.generated.executorch_flatbuffer import (
        Int,
        KernelTypes,
    )
    from executorch.exir._serialize.generated.executorch_flatbuffer import (
        Program as P,
    )

    b = flatbuffers.Builder(0)
    Int.IntStart(b)
    Int.IntAddIntVal(b, 7)
    iv = Int.IntEnd(b)
    EV.EValueStart(b)
    EV.EValueAddValType(b, KernelTypes.KernelTypes.Int)
    EV.EValueAddVal(b, iv)
    ev = EV.EValueEnd(b)
    EP.ExecutionPlanStartValuesVector(b, fanout)
    for _ in range(fanout):
        b.PrependUOffsetTRelative(ev)
    values = b.EndVector()
    name = b.CreateString("forward")
    EP.ExecutionPlanStart(b)
    EP.ExecutionPlanAddName(b, name)
    EP.ExecutionPlanAddValues(b, values)
    plan = EP.ExecutionPlanEnd(b)
    P.ProgramStartExecutionPlanVector(b, fanout)
    for _ in range(fanout):
        b.PrependUOffsetTRelative(plan)
    plans = b.EndVector()
    P.ProgramStart(b)
    P.ProgramAddExecutionPlan(b, plans)
    b.Finish(P.ProgramEnd(b), file_identifier=b"ET12")
    return bytes(b.Output())


def test_shared_offsets_are_refused_in_bounded_time(tmp_path):
    """Regression: a 240 KB crafted .pte used to unpack into ~9e8 objects."""
    import time

    path = tmp_path / "shared.pte"
    path.write_bytes(_shared_offsets_pte(30000))
    start = time.perf_counter()
    with pytest.raises(FormatError, match="more than 1,000,000 table visits"):
        read_artifact(str(path))
    assert time.perf_counter() - start < 10
