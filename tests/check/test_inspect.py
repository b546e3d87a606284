"""ptdstream.inspect: sections, keys, sizes, alignments and duplicate content."""

from __future__ import annotations

import hashlib
import json

import pytest
import xxhash
from _small_exports import assert_only, param_bytes, patched, write_reference

from ptdstream.check.inspection import alignment_of, inspect_files
from ptdstream.errors import FormatError

EXT_PTD = "_default_external_constant.ptd"


def test_alignment_of():
    assert [alignment_of(n) for n in (0, 1, 48, 128, 2176, 1 << 40)] == [None, 1, 16, 128, 128, 1 << 40]


def test_breakdown_adds_up_to_each_file_size(tmp_path):
    paths = []
    for kind in ("plain", "mutable", "xnnpack", "external", "xnnpack_ptd"):
        paths += write_reference(kind, tmp_path / kind).values()
    report = inspect_files(paths)
    for f in report.files:
        assert sum(r.nbytes for r in f.breakdown) == f.file_nbytes
        assert sum(s.nbytes for s in f.sections) == f.file_nbytes
    plain = report.files[0]
    assert (plain.total("metadata"), plain.total("padding"), plain.total("payload")) == (2152, 24, 204)
    assert [(r.category, r.name, r.nbytes) for r in plain.breakdown] == [
        ("metadata", "extended header", 32), ("metadata", "flatbuffer", 2120),
        ("padding", "padding", 24), ("payload", "constant segment", 204),
    ]
    assert "bytes: metadata 2,152 + padding 24 + payload 204 = 2,380" in report.summary()


def test_ptd_keys_sizes_layouts_and_alignments(tmp_path):
    path = write_reference("external", tmp_path)[EXT_PTD]
    (f,) = inspect_files([path]).files
    assert [(k.key, k.segment_index, k.nbytes, k.layout.sizes) for k in f.keys] == [
        ("a.weight", 0, 128, (4, 8)), ("a.bias", 1, 16, (4,)), ("b.weight", 2, 48, (3, 4)), ("b.bias", 3, 12, (3,)),
    ]
    assert [(s.start, s.alignment) for s in f.segments] == [(512, 512), (640, 128), (768, 256), (896, 128)]
    assert [(r.category, r.key, r.nbytes) for r in f.breakdown if r.category == "payload"] == [
        ("payload", "a.weight", 128), ("payload", "a.bias", 16), ("payload", "b.weight", 48), ("payload", "b.bias", 12),
    ]
    assert (f.total("metadata"), f.total("padding")) == (8 + 40 + 448, 8 + 8 + 112 + 80)
    assert f.header == {"flatbuffer_offset": 48, "flatbuffer_size": 456, "segment_base_offset": 512,
                        "segment_data_size": 396, "length": 40}
    assert_only(tmp_path, ["model.pte", EXT_PTD])


def test_duplicates_across_files_are_grouped_with_exact_bytes(tmp_path):
    xnn = write_reference("xnnpack", tmp_path / "x")["model.pte"]
    ptd = write_reference("external", tmp_path / "e")[EXT_PTD]
    report = inspect_files([xnn, ptd], chunk_nbytes=32)
    # Every weight is stored once in each file: XNNPACK named data and .ptd tensor.
    assert [(g.nbytes, len(g.members)) for g in report.duplicates] == [(128, 2), (48, 2), (16, 2), (12, 2)]
    assert report.duplicated_nbytes == 128 + 48 + 16 + 12
    top = report.duplicates[0]
    assert top.digest == xxhash.xxh3_128(param_bytes("external", "a.weight")).hexdigest()
    assert [(m.path, m.label, m.key, m.start) for m in top.members] == [
        (xnn, "named data", hashlib.sha256(param_bytes("xnnpack", "a.weight")).hexdigest(), 2816),
        (ptd, "named data", "a.weight", 512),
    ]
    assert "duplicated content: 204 bytes in 4 groups" in report.summary()


def test_duplicate_within_one_file_tied_embedding(tmp_path):
    path = write_reference("tied", tmp_path)["model.pte"]
    report = inspect_files([path])
    (group,) = report.duplicates
    # The embedding's weight is a program constant (portable embedding) and
    # XNNPACK named data (the tied linear): 64 x 16 float32 stored twice.
    assert group.nbytes == 4096 and report.duplicated_nbytes == 4096
    assert [(m.label, m.key) for m in group.members] == [
        ("constant segment", "constant 1"),
        ("named data", hashlib.sha256(param_bytes("tied", "embed.weight")).hexdigest()),
    ]
    assert [m.start for m in group.members] == [1536, 6272]
    assert_only(tmp_path, ["model.pte"])


def test_no_duplicates_in_a_single_plain_file(tmp_path):
    report = inspect_files([write_reference("plain", tmp_path)["model.pte"]])
    assert report.duplicates == () and report.duplicated_nbytes == 0
    assert report.summary().endswith("duplicated content: none")


def test_json_report(tmp_path):
    files = write_reference("xnnpack_ptd", tmp_path)
    report = inspect_files([files["model.pte"], files["model.ptd"]])
    data = json.loads(report.to_json())
    assert [f["kind"] for f in data["files"]] == ["pte", "ptd"]
    pte, ptd = data["files"]
    assert pte["totals"] == {"metadata": 968, "padding": 56, "payload": 1184, "trailing": 0}
    assert [s["label"] for s in pte["segments"]] == ["constant segment", "delegate blob XnnpackBackend"]
    assert pte["segments"][1]["alignment"] == 1024
    assert ptd["keys"][0]["layout"] is None and len(ptd["keys"]) == 4
    assert sum(r["nbytes"] for r in ptd["breakdown"]) == ptd["file_nbytes"] == 1036
    assert data["duplicated_nbytes"] == 0
    assert_only(tmp_path, ["model.pte", "model.ptd"])


def test_trailing_bytes_are_their_own_category(tmp_path):
    path = write_reference("plain", tmp_path)["model.pte"]
    with open(path, "ab") as f:
        f.write(b"\x00" * 44)
    (f,) = inspect_files([path]).files
    assert f.total("trailing") == 44 and sum(r.nbytes for r in f.breakdown) == 2424


def test_invalid_and_missing_files_raise(tmp_path):
    path = write_reference("plain", tmp_path)["model.pte"]
    patched(path, 4, b"ZZZZ")
    with pytest.raises(FormatError, match="at offset 4"):
        inspect_files([path])
    with pytest.raises(FileNotFoundError):
        inspect_files([tmp_path / "absent.ptd"])
    assert_only(tmp_path, ["model.pte"])
