"""ptdstream.verify: streamed byte comparison, manager comparison, structure checks."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tracemalloc

import pytest
from _small_exports import assert_only, manager, patched, truncated, write_reference
from hypothesis import given, settings
from hypothesis import strategies as st

import ptdstream
from ptdstream.check.compare import (
    CompareReport,
    _first_difference,
    _PieceFiller,
    compare_files,
    verify_against_manager,
)
from ptdstream.check.structure import check_structure
from ptdstream.format.reader import read_artifact

XNN_KEY0 = "2fde66a9f2012fda28059b58e6b15d99c8e0829e2113e99d2e25d5bad3d852b3"
EXT_PTD = "_default_external_constant.ptd"


def _flip(src, offset: int, out) -> str:
    with open(src, "rb") as f:
        f.seek(offset)
        value = f.read(1)[0]
    return patched(src, offset, bytes([value ^ 0xFF]), out=out)


def test_identical_files_are_ok(tmp_path):
    ref = write_reference("xnnpack", tmp_path / "ref")["model.pte"]
    out = shutil.copy(ref, tmp_path / "out.pte")
    report = compare_files(out, ref, chunk_nbytes=100)
    assert report.ok and report.first_diff_offset is None
    assert report.out_nbytes == report.ref_nbytes == 3212
    assert report.summary() == f"OK {out}: identical to {ref} (3,212 bytes)"
    assert json.loads(report.to_json())["ok"] is True


@pytest.mark.parametrize("offset,section,key", [
    (0, "flatbuffer", None),
    (20, "extended header", None),
    (1447, "flatbuffer", None),
    (1500, "padding", None),
    (1536, "delegate blob XnnpackBackend", None),
    (2816 + 5, "named data", XNN_KEY0),
    (3211, "named data", "37eff6c275ed40dff760e40ef8cfab82b136b2f011908c139b66648351f22cbf"),
])
@pytest.mark.parametrize("chunk_nbytes", [64, 1000, 8 << 20])
def test_flipped_byte_is_reported_at_its_offset_section_and_key(tmp_path, offset, section, key, chunk_nbytes):
    ref = write_reference("xnnpack", tmp_path / "ref")["model.pte"]
    out = _flip(ref, offset, tmp_path / "out.pte")
    report = compare_files(out, ref, chunk_nbytes=chunk_nbytes)
    assert not report.ok
    assert (report.first_diff_offset, report.section, report.key) == (offset, section, key)
    assert report.out_byte == report.ref_byte ^ 0xFF
    assert report.map_source == "reference"
    assert (report.out_nbytes, report.ref_nbytes) == (3212, 3212)
    assert f"first difference at offset {offset:,}" in report.summary()
    assert_only(tmp_path, ["ref", "out.pte"])


def test_constant_segment_mismatch_names_the_constant(tmp_path):
    ref = write_reference("plain", tmp_path / "ref")["model.pte"]
    out = _flip(ref, 2176 + 128 + 3, tmp_path / "out.pte")  # a.bias is constant 2, at 128
    report = compare_files(out, ref)
    assert (report.first_diff_offset, report.section, report.key) == (2307, "constant segment", "constant 2")


def test_truncated_and_extended_outputs(tmp_path):
    ref = write_reference("external", tmp_path / "ref")[EXT_PTD]
    cut = truncated(ref, 700, tmp_path / "cut.ptd")
    report = compare_files(cut, ref, chunk_nbytes=256)
    assert (report.first_diff_offset, report.out_byte, report.section, report.key) == (700, None, "padding", None)
    assert (report.out_nbytes, report.ref_nbytes) == (700, 908)
    assert "output <end of file>" in report.summary()
    cut2 = truncated(ref, 600, tmp_path / "cut2.ptd")
    assert compare_files(cut2, ref).key == "a.weight"
    longer = tmp_path / "long.ptd"
    longer.write_bytes(open(ref, "rb").read() + b"\x00" * 10)
    report = compare_files(longer, ref)
    assert (report.first_diff_offset, report.ref_byte, report.out_byte) == (908, None, 0)
    # Past the reference's end, the output's own map names the bytes.
    assert (report.section, report.map_source) == ("trailing bytes", "output")


def test_unparsable_reference_is_named_from_the_output_map(tmp_path):
    good = write_reference("external", tmp_path / "ref")[EXT_PTD]
    bad_ref = patched(good, 8, b"XXXX", out=tmp_path / "bad_ref.ptd")
    flipped = _flip(good, 640, tmp_path / "out.ptd")
    patched(flipped, 8, b"XXXX")
    report = compare_files(flipped, bad_ref)  # neither parses: offset only
    assert (report.first_diff_offset, report.section, report.key, report.map_source) == (640, None, None, None)
    assert "in unmapped bytes" in report.summary()
    # Output parses, reference does not: the output names it.
    report = compare_files(_flip(good, 640, tmp_path / "out2.ptd"), bad_ref)
    assert (report.first_diff_offset, report.section, report.key, report.map_source) == (
        8, "flat tensor header", None, "output")
    report = compare_files(_flip(good, 640, tmp_path / "out3.ptd"), patched(good, 900, b"\x01", out=tmp_path / "r.ptd"))
    assert (report.first_diff_offset, report.key, report.map_source) == (640, "a.bias", "reference")


def test_missing_input_raises_oserror(tmp_path):
    ref = write_reference("plain", tmp_path)["model.pte"]
    with pytest.raises(FileNotFoundError):
        compare_files(tmp_path / "absent.pte", ref)
    with pytest.raises(FileNotFoundError):
        compare_files(ref, tmp_path / "absent.pte")


def test_memory_stays_bounded_by_two_chunks(tmp_path):
    size = 24 << 20
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    block = os.urandom(1 << 20)
    with open(a, "wb") as fa, open(b, "wb") as fb:
        for _ in range(size >> 20):
            fa.write(block)
            fb.write(block)
    patched(b, size - 7, b"\x00" if block[-7] else b"\x01")
    tracemalloc.start()
    report = compare_files(a, b, chunk_nbytes=1 << 20)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert report.first_diff_offset == size - 7 and report.section is None
    assert peak < 3.5 * (1 << 20)
    os.remove(a)
    os.remove(b)
    assert_only(tmp_path, [])


@settings(max_examples=200, deadline=None)
@given(a=st.binary(max_size=300), b=st.binary(max_size=300), chunk=st.integers(1, 40),
       split=st.lists(st.integers(1, 50), max_size=10))
def test_first_difference_matches_naive_for_any_piece_boundaries(a, b, chunk, split):
    def pieces(data):
        pos = 0
        for n in split:
            yield memoryview(data)[pos : pos + n]
            pos += n
        yield data[pos:]

    expect = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if expect is None and len(a) != len(b):
        expect = min(len(a), len(b))
    offset, byte_a, byte_b = _first_difference(_PieceFiller(pieces(a)), _PieceFiller([b]), chunk)
    assert offset == expect
    if expect is not None:
        assert byte_a == (a[expect] if expect < len(a) else None)
        assert byte_b == (b[expect] if expect < len(b) else None)


@pytest.mark.parametrize("kind,names", [
    ("plain", ["model.pte"]),
    ("external", ["model.pte", EXT_PTD]),
    ("xnnpack_ptd", ["model.pte", "model.ptd"]),
])
def test_manager_verification_of_ptdstream_save(tmp_path, kind, names):
    ptdstream.save(manager(kind), str(tmp_path / "model.pte"))
    reports = verify_against_manager(manager(kind), tmp_path / "model.pte", chunk_nbytes=100)
    assert [os.path.basename(r.out_path) for r in reports] == names
    assert all(r.ok for r in reports), [r.summary() for r in reports]
    assert [r.ref_nbytes for r in reports] == [os.path.getsize(tmp_path / n) for n in names]
    assert_only(tmp_path, names)  # the reference was streamed, never written


def test_manager_verification_finds_a_flipped_ptd_byte_and_a_missing_file(tmp_path):
    write_reference("external", tmp_path)  # upstream's own files verify too
    reports = verify_against_manager(manager("external"), tmp_path / "model.pte")
    assert [r.ok for r in reports] == [True, True]
    _flip(tmp_path / EXT_PTD, 768 + 4, tmp_path / EXT_PTD)
    pte_report, ptd_report = verify_against_manager(manager("external"), tmp_path / "model.pte", chunk_nbytes=64)
    assert pte_report.ok
    assert (ptd_report.first_diff_offset, ptd_report.section, ptd_report.key) == (772, "named data", "b.weight")
    assert ptd_report.ref_path == f"executorch's serializer of the same manager ({EXT_PTD}, streamed, not written)"
    assert ptd_report.map_source == "reference"
    os.remove(tmp_path / EXT_PTD)
    _, missing = verify_against_manager(manager("external"), tmp_path / "model.pte")
    assert not missing.ok and missing.error == "expected file is missing" and missing.out_nbytes is None
    assert "MISMATCH" in missing.summary()
    assert_only(tmp_path, ["model.pte"])


def test_manager_verification_with_a_separate_data_dir(tmp_path):
    (tmp_path / "data").mkdir()
    ptdstream.save(manager("xnnpack_ptd"), str(tmp_path / "model.pte"), data_dir=str(tmp_path / "data"))
    reports = verify_against_manager(manager("xnnpack_ptd"), tmp_path / "model.pte", data_dir=tmp_path / "data")
    assert [r.ok for r in reports] == [True, True]
    assert reports[1].out_path == os.path.join(tmp_path / "data", "model.ptd")
    truncated(tmp_path / "model.pte", 1100, tmp_path / "model.pte")  # segments start at 1024
    report = verify_against_manager(manager("xnnpack_ptd"), tmp_path / "model.pte", data_dir=tmp_path / "data")[0]
    assert (report.first_diff_offset, report.section, report.out_byte) == (1100, "delegate blob XnnpackBackend", None)


def test_structure_of_program_with_its_data_file(tmp_path):
    files = write_reference("external", tmp_path)
    report = check_structure(files["model.pte"], [files[EXT_PTD]])
    assert report.ok, report.summary()
    names = {(os.path.basename(c.path), c.name) for c in report.checks}
    assert ("model.pte", "external data") in names and (EXT_PTD, "version") in names
    assert report.summary().endswith("OK: structure valid")
    assert json.loads(report.to_json())["ok"] is True


def test_structure_reports_missing_external_keys(tmp_path):
    files = write_reference("external", tmp_path)
    report = check_structure(files["model.pte"], [])
    pte, ptd = files["model.pte"], files[EXT_PTD]
    assert [(c.name, c.detail) for c in report.problems] == [
        ("external data", "no .ptd given; missing: 'a.weight', 'a.bias', 'b.weight', 'b.bias'; "
                          f"{ptd} beside it holds them: ptdstream verify {pte} {ptd}")
    ]
    assert report.summary().endswith("INVALID: 1 check failed")


def test_structure_reports_layout_mismatch(tmp_path):
    files = write_reference("external", tmp_path)
    data = open(files[EXT_PTD], "rb").read()
    at = data.find(struct.pack("<3I", 2, 4, 8))  # a.weight's sizes vector: [4, 8]
    assert at > 0 and data.find(struct.pack("<3I", 2, 4, 8), at + 1) == -1
    patched(files[EXT_PTD], at + 8, struct.pack("<I", 9))
    report = check_structure(files["model.pte"], [files[EXT_PTD]])
    assert [c.name for c in report.problems] == ["external layouts"]
    assert "'a.weight'" in report.problems[0].detail and "sizes=(4, 9)" in report.problems[0].detail


def test_structure_of_corrupt_wrong_kind_and_repeated_files(tmp_path):
    files = write_reference("external", tmp_path)
    ptd = files[EXT_PTD]
    copy = shutil.copy(ptd, tmp_path / "copy.ptd")
    report = check_structure(files["model.pte"], [ptd, copy])
    assert [c.name for c in report.problems] == ["keys unique across .ptd files"]
    report = check_structure(files["model.pte"], [files["model.pte"], ptd])
    assert [(os.path.basename(c.path), c.name) for c in report.problems] == [("model.pte", "kind")]
    bad = patched(files["model.pte"], 0, struct.pack("<I", 0xFFFFFF00), out=tmp_path / "bad.pte")
    report = check_structure(bad, [ptd])
    assert [(c.path, c.name) for c in report.problems] == [(bad, "parse")]
    assert report.problems[0].detail.startswith(
        f"{bad}: at offset 0: program flatbuffer (2216 bytes) fails the runtime's flatbuffer verification: "
        "root table offset 4294967040 is 0 or >= 2**31")
    with pytest.raises(FileNotFoundError):
        check_structure(tmp_path / "absent.pte", [ptd])
    assert_only(tmp_path, ["model.pte", EXT_PTD, "copy.ptd", "bad.pte"])


def test_structure_of_xnnpack_program_with_named_data(tmp_path):
    files = write_reference("xnnpack", tmp_path)
    report = check_structure(files["model.pte"])
    assert report.ok
    detail = {c.name: c.detail for c in report.checks}
    assert detail["named keys"] == "4 keys resolve to segments"
    assert detail["segments in bounds"] == "6 segments; base 1,536 + data 1,676 = 3,212 <= file size 3,212"
    assert isinstance(compare_files(files["model.pte"], files["model.pte"]), CompareReport)
    assert read_artifact(files["model.pte"]).segments[1].label == "delegate blob XnnpackBackend"
