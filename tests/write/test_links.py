"""Symlinked targets are written through the link, atomically; an update keeps
the target's mode."""

from __future__ import annotations

import os
import stat

import pytest

from ptdstream import ChunkedFileSink, StreamingNamedDataStore
from ptdstream.save import write_data_files


def write(path, data: bytes) -> None:
    with ChunkedFileSink(str(path)) as sink:
        sink.write(data)


def test_a_symlinked_target_is_written_through_the_link(tmp_path):
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    real = real_dir / "model.pte"
    real.write_bytes(b"old")
    link = tmp_path / "model.pte"
    link.symlink_to(real)
    write(link, b"new bytes")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_bytes() == b"new bytes"
    assert sorted(os.listdir(real_dir)) == ["model.pte"]
    assert sorted(os.listdir(tmp_path)) == ["model.pte", "real"]


def test_a_chain_of_links_and_a_dangling_link(tmp_path):
    (tmp_path / "d").mkdir()
    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to("b")  # relative
    b.symlink_to(tmp_path / "d" / "final.bin")  # dangling until written
    write(a, b"through two links")
    assert (tmp_path / "d" / "final.bin").read_bytes() == b"through two links"
    assert a.is_symlink() and b.is_symlink()


def test_the_temp_file_is_beside_the_links_target(tmp_path):
    (tmp_path / "d").mkdir()
    real = tmp_path / "d" / "w.ptd"
    real.write_bytes(b"old")
    (tmp_path / "w.ptd").symlink_to(real)
    sink = ChunkedFileSink(str(tmp_path / "w.ptd"))
    try:
        assert os.path.dirname(sink.temp_path) == str(tmp_path / "d")
    finally:
        sink.abort()
    assert sorted(os.listdir(tmp_path / "d")) == ["w.ptd"]


@pytest.mark.parametrize("mode", [0o444, 0o640, 0o600])
def test_an_update_keeps_the_targets_mode(tmp_path, mode):
    target = tmp_path / "model.pte"
    target.write_bytes(b"old")
    target.chmod(mode)
    write(target, b"new")
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(target).st_mode) == mode


def test_a_set_written_through_links_in_a_data_folder(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "w.ptd").write_bytes(b"old")
    (tmp_path / "w.ptd").symlink_to(data / "w.ptd")
    store = StreamingNamedDataStore()
    store.add_named_data("k", b"\x01" * 16, external_tag="w")
    store.add_named_data("j", b"\x02" * 16, external_tag="v")
    write_data_files(store, str(tmp_path))
    assert (tmp_path / "w.ptd").is_symlink()
    assert (data / "w.ptd").read_bytes()[4:8] == b"FT01"
    assert sorted(os.listdir(data)) == ["w.ptd"]
    assert sorted(os.listdir(tmp_path)) == ["data", "v.ptd", "w.ptd"]
