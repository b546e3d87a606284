"""Plain zstd files (no seek table, any zstd tool's): ``unpack`` streams them as
``zstd -d`` does; a file that is no zstd, or a .pte/.ptd itself, is told so; a packed
file named where a .pte/.ptd is expected points at ``unpack``."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess

import pytest
import zstandard

from ptdstream import FormatError, IntegrityError
from ptdstream.cli import main as cli_main
from ptdstream.format.reader import read_artifact
from ptdstream.pack import PackedArtifact, pack, unpack

CONTENT = bytes(range(256)) * 4096 + b"tail"  # 1 MiB and 4 bytes


def _frames(*parts: bytes, checksum: bool = True) -> bytes:
    """One zstd frame per part (as ``zstd`` writes a file, or several files concatenated)."""
    compressor = zstandard.ZstdCompressor(write_checksum=checksum)
    return b"".join(compressor.compress(p) for p in parts)


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_unpack_streams_a_plain_zstd_file_across_its_frames(tmp_path, capsys):
    skippable = struct.pack("<II", 0x184D2A50, 5) + b"notes"
    (tmp_path / "w.bin.zst").write_bytes(_frames(CONTENT[:1000]) + skippable + _frames(CONTENT[1000:]))
    code, out, err = _run(capsys, "unpack", tmp_path / "w.bin.zst")
    assert (code, err) == (0, "")
    assert (tmp_path / "w.bin").read_bytes() == CONTENT
    assert out.startswith(f"unpacked {tmp_path / 'w.bin.zst'} -> {tmp_path / 'w.bin'}: 1,048,580 bytes from 2 frames "
                          "of a plain zstd file (no seek table: streamed), ")
    assert out.endswith("; verified: zstd frame checksums\n")


def test_a_plain_file_without_checksums_says_nothing_was_verified(tmp_path):
    (tmp_path / "w.zst").write_bytes(_frames(CONTENT, checksum=False))
    report = unpack(str(tmp_path / "w.zst"), str(tmp_path / "w"))
    assert (tmp_path / "w").read_bytes() == CONTENT
    assert (report.plain, report.frames, report.checks) == (True, 1, ())
    assert report.summary().endswith("verified: NOTHING (the file carries no checksums)")


@pytest.mark.skipif(shutil.which("zstd") is None, reason="the zstd command is not installed")
def test_the_zstd_commands_own_file_unpacks(tmp_path):
    (tmp_path / "w").write_bytes(CONTENT)
    subprocess.run(["zstd", "-q", "-19", str(tmp_path / "w"), "-o", str(tmp_path / "w.zst")], check=True)
    report = unpack(str(tmp_path / "w.zst"), str(tmp_path / "back"))
    assert (tmp_path / "back").read_bytes() == CONTENT and report.checks == ("zstd frame checksums",)


def test_a_corrupt_plain_frame_publishes_nothing(tmp_path):
    data = bytearray(_frames(os.urandom(1 << 16)))
    data[len(data) // 2] ^= 0x10
    (tmp_path / "w.zst").write_bytes(bytes(data))
    (tmp_path / "w").write_bytes(b"previous")
    with pytest.raises(IntegrityError, match=r"w\.zst: does not decompress: .*; nothing was published"):
        unpack(str(tmp_path / "w.zst"), str(tmp_path / "w"))
    assert (tmp_path / "w").read_bytes() == b"previous"
    assert sorted(os.listdir(tmp_path)) == ["w", "w.zst"]


def test_a_truncated_plain_file_is_refused_before_anything_is_written(tmp_path):
    data = _frames(os.urandom(1 << 16))
    (tmp_path / "w.zst").write_bytes(data[:-100])
    with pytest.raises(FormatError, match=rf"w\.zst: at offset 0: frame 0: frame needs {len(data)} bytes, "
                                          rf"{len(data) - 100} given \(truncated\)"):
        unpack(str(tmp_path / "w.zst"), str(tmp_path / "w"))
    assert sorted(os.listdir(tmp_path)) == ["w.zst"]


def test_a_packed_file_cut_before_its_seek_table_still_checks_its_content(tmp_path):
    """A packed file without its seek table is a plain zstd file that still holds
    ptdstream's content frame: the content's size and xxh3-128 are checked too."""
    (tmp_path / "a").write_bytes(CONTENT)
    pack(str(tmp_path / "a"), str(tmp_path / "a.zst"), frame_nbytes=1 << 16)
    data = (tmp_path / "a.zst").read_bytes()
    table = data.rindex(struct.pack("<I", 0x184D2A5E))
    (tmp_path / "cut.zst").write_bytes(data[:table])
    report = unpack(str(tmp_path / "cut.zst"), str(tmp_path / "cut"))
    assert (tmp_path / "cut").read_bytes() == CONTENT
    assert (report.plain, report.frames, report.checks) == (True, 17, ("zstd frame checksums", "content xxh3-128"))
    # One frame swapped for another valid frame of other bytes: each frame decodes, the content does not match.
    first = zstandard.ZstdCompressor(write_checksum=True).compress(CONTENT[:1 << 16])
    assert data.startswith(first)
    other = zstandard.ZstdCompressor(write_checksum=True).compress(bytes(1 << 16))
    (tmp_path / "swapped.zst").write_bytes(other + data[len(first):table])
    with pytest.raises(IntegrityError, match=r"swapped\.zst: the decompressed content \(1,048,580 bytes, xxh3-128 "
                                             r"[0-9a-f]{32}\) is not what its ptdstream manifest says \(1,048,580 "
                                             r"bytes, [0-9a-f]{32}\); nothing was published"):
        unpack(str(tmp_path / "swapped.zst"), str(tmp_path / "swapped"))
    assert not (tmp_path / "swapped").exists()


def test_unpack_of_a_file_that_is_no_zstd_says_what_it_is(tmp_path, capsys):
    (tmp_path / "notes.txt").write_bytes(b"hello notes")
    (tmp_path / "model.ptd").write_bytes(b"\x18\x00\x00\x00FT01" + bytes(32))
    code, _, err = _run(capsys, "unpack", tmp_path / "notes.txt", "-o", tmp_path / "x")
    assert (code, err) == (1, f"ptdstream: invalid file: {tmp_path / 'notes.txt'}: not a zstd file: it starts with "
                              "0x6C6C6568, where a zstd frame starts with 0xFD2FB528; nothing to unpack or extract\n")
    code, _, err = _run(capsys, "unpack", tmp_path / "model.ptd", "-o", tmp_path / "x")
    assert (code, err) == (1, f"ptdstream: invalid file: {tmp_path / 'model.ptd'}: a .ptd itself (identifier FT01), "
                              "not a packed file: nothing to unpack or extract (ptdstream pack makes a packed file "
                              "of it)\n")
    code, _, err = _run(capsys, "extract", tmp_path / "notes.txt", "--list")
    assert code == 1 and "not a zstd file: it starts with 0x6C6C6568" in err
    assert sorted(os.listdir(tmp_path)) == ["model.ptd", "notes.txt"]


def test_extract_of_a_plain_file_points_at_unpack(tmp_path):
    (tmp_path / "w.zst").write_bytes(_frames(CONTENT))
    with pytest.raises(FormatError, match=r"w\.zst: at offset \d+: last 4 bytes are 0x[0-9A-F]{8}, not the seekable "
                                          r"magic 0x8F92EAB1: a plain zstd file \(no seek table: ptdstream unpack "
                                          r"streams it; extract needs a file ptdstream pack made\), or a packed file "
                                          r"cut short"):
        PackedArtifact(str(tmp_path / "w.zst"))


@pytest.mark.parametrize("packed", [True, False])
def test_a_packed_file_named_as_a_pte_or_ptd_points_at_unpack(tmp_path, capsys, packed):
    """``inspect model.ptd.zst`` (and the readers under verify) say what the file is and
    what to run, instead of "identifier ... is neither ET.. nor FT..". """
    (tmp_path / "a").write_bytes(CONTENT)
    z = tmp_path / "model.ptd.zst"
    if packed:
        pack(str(tmp_path / "a"), str(z))
    else:
        z.write_bytes(_frames(CONTENT))
    message = (f"{z}: at offset 0: a zstd-compressed file (ptdstream pack's, or any zstd tool's), not a .pte/.ptd: "
               f"ptdstream unpack {z} gives the file (ptdstream extract {z} --list: what a packed one holds)")
    with pytest.raises(FormatError) as info:
        read_artifact(str(z))
    assert str(info.value) == message
    code, _, err = _run(capsys, "inspect", z)
    assert (code, err) == (1, f"ptdstream: invalid file: {message}\n")
