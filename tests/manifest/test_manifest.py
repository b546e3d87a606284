"""Integrity manifests: deterministic bytes, exact first bad piece / section / key."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import Mlp, export
from executorch.exir import ExecutorchBackendConfig

import ptdstream
from ptdstream.cli import main
from ptdstream.errors import FormatError
from ptdstream.manifest.codec import from_bytes, to_bytes
from ptdstream.manifest.describe import describe_file, write_manifest
from ptdstream.manifest.verify import read_manifest, verify_manifest


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    import torch

    manager = export(
        Mlp(256, 128, 8),
        config=ExecutorchBackendConfig(external_constants=True),
        inputs=(torch.randn(2, 256),),
    )
    report = ptdstream.save(manager, str(folder / "model.pte"), manifest=True)
    return folder, report


def test_save_writes_a_manifest_equal_to_the_command_s(saved, tmp_path):
    folder, report = saved
    assert report.manifest_path == str(folder / "model.manifest")
    paths = [f.path for f in report.files]
    out = tmp_path / "again.manifest"
    assert main(["manifest", *paths, "-o", str(out)]) == 0
    assert out.read_bytes() == (folder / "model.manifest").read_bytes()
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in paths:
        shutil.copy(p, copy)
    moved = [str(copy / os.path.basename(p)) for p in paths]
    assert to_bytes(read_manifest(str(out))) == out.read_bytes()
    write_manifest(moved, str(tmp_path / "moved.manifest"))
    assert (tmp_path / "moved.manifest").read_bytes() == out.read_bytes(), "depends only on the files"


def test_copy_checks_ok_and_a_flipped_byte_names_piece_section_and_key(saved, tmp_path):
    folder, report = saved
    manifest = read_manifest(report.manifest_path)
    ptd = tmp_path / "_default_external_constant.ptd"
    shutil.copy(folder / "_default_external_constant.ptd", ptd)
    assert verify_manifest(str(ptd), manifest).ok
    entry = next(f for f in manifest.files if f.name == ptd.name)
    target = next(s for s in entry.sections if s.key == "l2.weight")
    data = bytearray(ptd.read_bytes())
    data[target.offset + 5] ^= 0xFF
    ptd.write_bytes(bytes(data))
    check = verify_manifest(str(ptd), manifest)
    assert not check.ok
    assert check.first_bad_piece == 0 and check.key == "l2.weight" and check.bad_keys == ("l2.weight",)
    assert main(["verify", str(ptd), "--manifest", report.manifest_path]) == 1


def test_small_pieces_locate_the_exact_piece(saved, tmp_path):
    folder, _ = saved
    src = folder / "_default_external_constant.ptd"
    manifest_path = tmp_path / "m.manifest"
    manifest = write_manifest([str(src)], str(manifest_path), piece_nbytes=4096)
    ptd = tmp_path / src.name
    data = bytearray(src.read_bytes())
    data[70_000] ^= 1
    ptd.write_bytes(bytes(data))
    check = verify_manifest(str(ptd), manifest)
    assert check.first_bad_piece == 70_000 // 4096 and check.first_bad_offset == (70_000 // 4096) * 4096
    ptd.write_bytes(bytes(data[:-10]))
    assert "size" in verify_manifest(str(ptd), manifest).message


def test_corrupt_manifest_is_a_format_error(saved):
    _, report = saved
    with open(report.manifest_path, "rb") as f:
        data = f.read()
    with pytest.raises(FormatError, match="not a ptdstream manifest"):
        from_bytes(b"\0" * 16)
    for cut in (9, len(data) // 2, len(data) - 3):
        try:
            from_bytes(data[:cut])
        except FormatError:
            pass
    assert main(["verify", report.manifest_path, "--manifest", report.manifest_path]) == 1


def test_any_file_gets_pieces_only(tmp_path):
    blob = tmp_path / "notes.txt"
    blob.write_bytes(b"hello" * 4096)
    fm = describe_file(str(blob), 4096)
    assert fm.kind == "file" and len(fm.pieces) == 5 and fm.keys == () and fm.sections == ()


def test_generated_manifest_code_matches_a_fresh_generation(tmp_path):
    """ptdstream/manifest/manifest_fb/ is what tools/gen_manifest_schema.sh makes from
    schema/manifest.fbs with executorch's flatc, byte for byte."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(root / "tools" / "gen_manifest_schema.sh"), str(tmp_path)], check=True,
                   env=env, capture_output=True)
    fresh = tmp_path / "ptdstream" / "check" / "manifest_fb"
    committed = root / "ptdstream" / "check" / "manifest_fb"
    names = sorted(p.name for p in committed.glob("*.py"))
    assert names == sorted(p.name for p in fresh.glob("*.py"))
    for name in names:
        assert (fresh / name).read_bytes() == (committed / name).read_bytes(), name
