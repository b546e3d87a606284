"""pack / unpack / extract: the seekable zstd layout byte by byte, exact round trips,
`zstd -d` interop, random access that decodes only the frames it needs, exact errors
on corrupt input, and nothing published or left behind on failure."""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import subprocess

import pytest
import xxhash
import zstandard
from conftest import Mlp, export

from ptdstream import FormatError, IntegrityError, LayoutError, StateError
from ptdstream.cli import main as cli_main
from ptdstream.cli.common import parse_nbytes
from ptdstream.errors import MissingKeyError
from ptdstream.format.reader import read_artifact
from ptdstream.pack import PackedArtifact, artifact_head, pack, plan_frames, unpack
from ptdstream.pack.seek_table import encode_seek_table, frame_checksum
from ptdstream.pack.seekable import SeekableReader

ZSTD = shutil.which("zstd")
needs_zstd = pytest.mark.skipif(ZSTD is None, reason="the zstd command is not installed")


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """A real .ptd (4 named tensors), its .pte, and a .pte holding a constant segment."""
    from executorch.exir import ExecutorchBackendConfig

    import ptdstream

    folder = tmp_path_factory.mktemp("artifacts")
    os.makedirs(folder / "ext")
    os.makedirs(folder / "const")
    ptdstream.save(export(Mlp(), config=ExecutorchBackendConfig(external_constants=True)),
                   str(folder / "ext" / "model.pte"))
    ptdstream.save(export(Mlp()), str(folder / "const" / "model.pte"))
    return {
        "ptd": str(folder / "ext" / "_default_external_constant.ptd"),
        "pte": str(folder / "ext" / "model.pte"),
        "const_pte": str(folder / "const" / "model.pte"),
    }


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def layout(data: bytes):
    """An independent parse of the seekable format: (descriptor, [(c_off, c_n, d_n, checksum)])."""
    count, descriptor, magic = struct.unpack_from("<IBI", data, len(data) - 9)
    assert magic == 0x8F92EAB1
    entry = 12 if descriptor & 0x80 else 8
    table = len(data) - (8 + count * entry + 9)
    assert struct.unpack_from("<II", data, table) == (0x184D2A5E, count * entry + 9)
    frames, c_off = [], 0
    for i in range(count):
        c_n, d_n = struct.unpack_from("<II", data, table + 8 + i * entry)
        checksum = struct.unpack_from("<I", data, table + 16 + i * entry)[0] if entry == 12 else None
        frames.append((c_off, c_n, d_n, checksum))
        c_off += c_n
    assert c_off == table
    return descriptor, frames


def table_entry_offset(data: bytes, index: int) -> int:
    count, descriptor, _ = struct.unpack_from("<IBI", data, len(data) - 9)
    entry = 12 if descriptor & 0x80 else 8
    return len(data) - (count * entry + 9) + index * entry


def only(folder, *names):
    assert sorted(os.listdir(folder)) == sorted(names)


# ---------------------------------------------------------------- layout


def test_plan_frames_cuts_at_piece_multiples_and_at_the_metadata_end():
    assert plan_frames(10_000, 4096, 504) == [(0, 504), (504, 3592), (4096, 4096), (8192, 1808)]
    assert plan_frames(8192, 4096, 4096) == [(0, 4096), (4096, 4096)]
    assert plan_frames(100, 4096, 500) == [(0, 100)]
    assert plan_frames(0, 4096) == []
    with pytest.raises(LayoutError, match="frame size 0 bytes"):
        plan_frames(10, 0)


def test_artifact_head_reads_metadata_end_from_the_header(artifacts):
    for key in ("ptd", "pte", "const_pte"):
        data = read(artifacts[key])
        kind, head = artifact_head(data[:64], len(data))
        assert (kind, head) == (key[-3:], read_artifact(artifacts[key]).flatbuffer_end)
    assert artifact_head(b"\0" * 64, 1000) == ("", 0)


def test_packed_ptd_follows_the_seekable_format_byte_by_byte(artifacts, tmp_path):
    src, dst = artifacts["ptd"], str(tmp_path / "m.zst")
    original = read(src)
    report = pack(src, dst, frame_nbytes=1024)
    data = read(dst)
    descriptor, frames = layout(data)
    assert descriptor == 0x80 and report.packed_nbytes == len(data)
    assert [d for _, _, d, _ in frames[:-1]] == [n for _, n in plan_frames(len(original), 1024, 504)]
    d_off = 0
    for c_off, c_n, d_n, checksum in frames[:-1]:
        frame = data[c_off : c_off + c_n]
        params = zstandard.get_frame_parameters(frame)
        assert params.content_size == d_n and params.has_checksum
        piece = zstandard.ZstdDecompressor().decompress(frame, allow_extra_data=False)
        assert piece == original[d_off : d_off + d_n]
        assert checksum == xxhash.xxh64_intdigest(piece) & 0xFFFFFFFF == struct.unpack("<I", frame[-4:])[0]
        d_off += d_n
    c_off, c_n, d_n, checksum = frames[-1]
    manifest = data[c_off : c_off + c_n]
    assert (c_n, d_n, checksum) == (60, 0, xxhash.xxh64_intdigest(b"") & 0xFFFFFFFF)
    assert struct.unpack_from("<II4sHHQ16sQQ", manifest) == (
        0x184D2A5D, 52, b"PTDZ", 1, 0, len(original), xxhash.xxh3_128_digest(original), 1024, 504)
    assert report.content_xxh3_128 == xxhash.xxh3_128_hexdigest(original)
    assert (report.kind, report.frames, report.head_nbytes) == ("ptd", 11, 504)
    only(tmp_path, "m.zst")


def test_seek_table_without_checksums_has_8_byte_entries(tmp_path):
    write(tmp_path / "a", b"x" * 5000)
    pack(str(tmp_path / "a"), str(tmp_path / "a.zst"), frame_nbytes=2000, checksums=False)
    descriptor, frames = layout(read(tmp_path / "a.zst"))
    assert descriptor == 0 and [f[2] for f in frames] == [2000, 2000, 1000, 0]
    assert encode_seek_table([(10, 20, 0)], False) == struct.pack("<IIIIIBI", 0x184D2A5E, 17, 10, 20, 1, 0, 0x8F92EAB1)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("key", ["ptd", "pte", "const_pte"])
def test_unpack_gives_the_exact_bytes_and_reports_every_check(artifacts, tmp_path, key):
    src = artifacts[key]
    pack(src, str(tmp_path / "p.zst"), frame_nbytes=1000)
    report = unpack(str(tmp_path / "p.zst"), str(tmp_path / "out"))
    assert read(tmp_path / "out") == read(src)
    assert report.checks == ("zstd frame checksums", "seek table checksums", "content xxh3-128")
    assert report.nbytes == os.path.getsize(src)
    only(tmp_path, "p.zst", "out")


@needs_zstd
def test_zstd_command_decompresses_our_output(artifacts, tmp_path):
    mixed = os.urandom(300_000) + bytes(500_000) + read(artifacts["ptd"]) * 10
    write(tmp_path / "in", mixed)
    pack(str(tmp_path / "in"), str(tmp_path / "in.zst"), frame_nbytes=64 << 10, level=5)
    out = subprocess.run([ZSTD, "-d", "-c", "-q", str(tmp_path / "in.zst")], check=True, capture_output=True).stdout
    assert out == mixed
    subprocess.run([ZSTD, "-t", "-q", str(tmp_path / "in.zst")], check=True)


@needs_zstd
def test_empty_file_round_trips_with_zstd_too(tmp_path):
    write(tmp_path / "e", b"")
    report = pack(str(tmp_path / "e"), str(tmp_path / "e.zst"))
    assert report.frames == 0 and layout(read(tmp_path / "e.zst"))[1] == [(0, 60, 0, 0x51D8E999)]
    assert unpack(str(tmp_path / "e.zst"), str(tmp_path / "e2")).nbytes == 0 and read(tmp_path / "e2") == b""
    assert subprocess.run([ZSTD, "-d", "-c", str(tmp_path / "e.zst")], capture_output=True, check=True).stdout == b""


def test_output_does_not_depend_on_threads(tmp_path):
    data = b"".join(bytes([i]) * 3000 + os.urandom(1000) for i in range(40))
    write(tmp_path / "in", data)
    pack(str(tmp_path / "in"), str(tmp_path / "a.zst"), frame_nbytes=4096, threads=1)
    pack(str(tmp_path / "in"), str(tmp_path / "b.zst"), frame_nbytes=4096, threads=3, verify=True)
    assert read(tmp_path / "a.zst") == read(tmp_path / "b.zst")


def test_unpack_reads_a_foreign_file_without_checksums_or_content_sizes(tmp_path):
    """Frames without content size or checksum, a skippable frame listed with size 0,
    no checksums in the seek table: every byte still comes back; nothing is claimed."""
    cctx = zstandard.ZstdCompressor(write_content_size=False, write_checksum=False)
    parts = [b"alpha" * 500, b"beta" * 700, b"gamma" * 10]
    frames = [cctx.compress(p) for p in parts]
    skip = struct.pack("<II", 0x184D2A50, 3) + b"abc"
    body = frames[0] + skip + frames[1] + frames[2]
    entries = [(len(frames[0]), len(parts[0]), 0), (len(skip), 0, 0)] + [
        (len(f), len(p), 0) for f, p in zip(frames[1:], parts[1:], strict=True)]
    write(tmp_path / "f.zst", body + encode_seek_table(entries, False))
    report = unpack(str(tmp_path / "f.zst"), str(tmp_path / "out"))
    assert read(tmp_path / "out") == b"".join(parts) and report.checks == ()
    with SeekableReader(str(tmp_path / "f.zst")) as reader:
        assert reader.content is None
        assert reader.read_at(2495, 10) == b"alphabetab"


# ---------------------------------------------------------------- random access


def test_extract_one_key_decodes_only_the_head_and_its_frames(artifacts, tmp_path):
    src, dst = artifacts["ptd"], str(tmp_path / "m.zst")
    original, art = read(src), read_artifact(src)
    pack(src, dst, frame_nbytes=1024)
    with PackedArtifact(dst) as packed:
        assert packed.reader.frames_decoded == 1  # the 504-byte metadata frame
        assert [(s.start, s.nbytes, s.keys) for s in packed.artifact.segments] == [
            (s.start, s.nbytes, s.keys) for s in art.segments]
        seg = art.segments[art.keys["l2.bias"]]
        assert packed.read("l2.bias") == original[seg.start : seg.end]
        assert packed.reader.frames_decoded == 2  # + frame [9216, 9888)
        report = packed.extract(str(tmp_path / "w.bin"), key="l1.weight")
        seg = art.segments[art.keys["l1.weight"]]
        assert read(tmp_path / "w.bin") == original[seg.start : seg.end] and len(original[seg.start : seg.end]) == 8192
        assert (report.offset, report.nbytes, report.frames_decoded, report.frames_total) == (512, 8192, 9, 11)
    only(tmp_path, "m.zst", "w.bin")


def test_extract_segment_of_a_pte_and_unknown_names(artifacts, tmp_path):
    src = artifacts["const_pte"]
    art = read_artifact(src)
    pack(src, str(tmp_path / "c.zst"), frame_nbytes=512)
    with PackedArtifact(str(tmp_path / "c.zst")) as packed:
        seg = art.segments[0]
        assert seg.label == "constant segment" and seg.nbytes > 0
        assert packed.read(index=0) == read(src)[seg.start : seg.end]
        with pytest.raises(MissingKeyError, match=r"c\.zst: no key 'nope'; it has 0 keys"):
            packed.read("nope")
        with pytest.raises(MissingKeyError, match="no segment 7; it has 1 segments"):
            packed.read(index=7)


def test_packed_file_that_is_not_an_artifact_raises_format_error(tmp_path):
    write(tmp_path / "r", b"not a model at all" * 100)
    pack(str(tmp_path / "r"), str(tmp_path / "r.zst"))
    with pytest.raises(FormatError, match=r"r\.zst \(decompressed\): at offset 4: identifier"):
        PackedArtifact(str(tmp_path / "r.zst"))


# ---------------------------------------------------------------- bad input


@pytest.fixture
def packed(artifacts, tmp_path):
    """(path of a packed .ptd in 1 KiB frames, its bytes, its frames)."""
    path = str(tmp_path / "m.zst")
    pack(artifacts["ptd"], path, frame_nbytes=1024)
    data = read(path)
    return path, data, layout(data)[1]


def corrupt_and_unpack(tmp_path, path, data, exc, pattern):
    write(path, data)
    target = tmp_path / "out.ptd"
    target.write_bytes(b"previous")
    with pytest.raises(exc, match=pattern):
        unpack(path, str(target))
    assert target.read_bytes() == b"previous"
    only(tmp_path, os.path.basename(path), "out.ptd")


def test_flipped_byte_in_a_frame_is_an_integrity_error(tmp_path, packed):
    path, data, frames = packed
    c_off, c_n, d_n, _ = frames[3]
    bad = bytearray(data)
    bad[c_off + c_n // 2] ^= 0x40
    corrupt_and_unpack(tmp_path, path, bytes(bad), IntegrityError,
                       rf"m\.zst: frame 3 at offset {c_off} \({c_n} bytes, content \[2048, 3072\)\): "
                       r"(does not decompress|seek table checksum)")


@pytest.mark.parametrize("cut", [1, 9, 200])
def test_truncated_file_is_a_format_error(tmp_path, packed, cut):
    path, data, _ = packed
    # Without its seek table's last magic, unpack walks the file as a plain zstd file
    # (zstd -d): the frame the cut runs through is named, and called truncated.
    corrupt_and_unpack(tmp_path, path, data[:-cut], FormatError,
                       rf"m\.zst: at offset \d+: (a skippable frame of \d+ bytes runs beyond the end of the file "
                       rf"\({len(data) - cut:,} bytes\)|frame \d+: .* given \(truncated\))")
    # extract needs the seek table: it names the magic that is not there.
    with pytest.raises(FormatError, match=rf"m\.zst: at offset {len(data) - cut - 4}: last 4 bytes are "
                                          r"0x[0-9A-F]{8}, not the seekable magic 0x8F92EAB1: a plain zstd file "
                                          r"\(no seek table: ptdstream unpack streams it; extract needs a file "
                                          r"ptdstream pack made\), or a packed file cut short"):
        PackedArtifact(path)


def test_seek_table_compressed_sizes_that_disagree_with_the_frames(tmp_path, packed):
    path, data, frames = packed
    bad = bytearray(data)
    e0, e1 = table_entry_offset(data, 0), table_entry_offset(data, 1)
    struct.pack_into("<I", bad, e0, frames[0][1] + 1)  # total unchanged: frame 1 one byte shorter
    struct.pack_into("<I", bad, e1, frames[1][1] - 1)
    corrupt_and_unpack(tmp_path, path, bytes(bad), FormatError,
                       rf"frame 0 at offset 0 \({frames[0][1] + 1} bytes, content \[0, 504\)\): "
                       rf"the zstd frame is {frames[0][1]} bytes, the seek table says {frames[0][1] + 1}")


def test_seek_table_total_that_disagrees_with_the_file(tmp_path, packed):
    path, data, frames = packed
    bad = bytearray(data)
    struct.pack_into("<I", bad, table_entry_offset(data, 2), frames[2][1] + 7)
    table_offset = len(data) - (8 + len(frames) * 12 + 9)
    corrupt_and_unpack(tmp_path, path, bytes(bad), FormatError,
                       rf"at offset {table_offset}: the seek table lists {len(frames)} frames of "
                       rf"{table_offset + 7} compressed bytes in all, but {table_offset} bytes precede")


def test_seek_table_decompressed_size_that_disagrees_with_the_frame(tmp_path, packed):
    path, data, frames = packed
    bad = bytearray(data)
    struct.pack_into("<I", bad, table_entry_offset(data, 1) + 4, 519)  # total unchanged: frame 2 + 1
    struct.pack_into("<I", bad, table_entry_offset(data, 2) + 4, 1025)
    corrupt_and_unpack(tmp_path, path, bytes(bad), FormatError,
                       rf"frame 1 at offset {frames[1][0]} .*frame header says 520 decompressed bytes, "
                       "the seek table says 519")


def test_wrong_seek_table_checksum(tmp_path, packed):
    path, data, frames = packed
    bad = bytearray(data)
    struct.pack_into("<I", bad, table_entry_offset(data, 5) + 8, frames[5][3] ^ 1)
    corrupt_and_unpack(tmp_path, path, bytes(bad), IntegrityError,
                       rf"frame 5 at offset {frames[5][0]} .*: seek table checksum 0x{frames[5][3] ^ 1:08X}, "
                       rf"decompressed bytes give 0x{frames[5][3]:08X}")


def test_reserved_descriptor_bits_and_frame_count(tmp_path, packed):
    path, data, frames = packed
    bad = bytearray(data)
    bad[-5] |= 0x04
    corrupt_and_unpack(tmp_path, path, bytes(bad), FormatError, r"descriptor 0x84 sets reserved bits")
    bad = bytearray(data)
    struct.pack_into("<I", bad, len(data) - 9, 10**6)
    corrupt_and_unpack(tmp_path, path, bytes(bad), FormatError, "seek table claims 1000000 frames")


def test_content_that_disagrees_with_the_manifest(tmp_path, packed):
    """Every frame intact, but the manifest names other content: not published."""
    path, data, frames = packed
    c_off = frames[-1][0]
    body = bytearray(data[c_off + 8 : c_off + 56])
    body[20] ^= 0xFF  # first digest byte
    bad = data[: c_off + 8] + bytes(body) + struct.pack("<I", frame_checksum(bytes(body))) + data[c_off + 60 :]
    corrupt_and_unpack(tmp_path, path, bad, IntegrityError,
                       r"m\.zst: the decompressed content's xxh3-128 is [0-9a-f]{32}, the manifest says")
    bad = bytearray(data)
    bad[c_off + 30] ^= 1  # a manifest field without fixing its own checksum
    corrupt_and_unpack(tmp_path, path, bytes(bad), FormatError, "manifest is corrupt")


def test_frames_over_the_memory_limit_are_refused_before_any_allocation(tmp_path, packed):
    path, _, frames = packed
    with pytest.raises(FormatError, match=rf"frame 2 at offset {frames[2][0]} .*decompressed size 1024 is over "
                       "the limit of 600 bytes a frame"):
        unpack(path, str(tmp_path / "out"), max_frame_nbytes=600)
    only(tmp_path, "m.zst")


def test_reader_close_is_idempotent_and_final(packed):
    reader = SeekableReader(packed[0])
    assert reader.read_at(4, 4) == b"FT01" and not reader.closed
    reader.close()
    reader.close()
    with pytest.raises(StateError, match=r"reader of .*m\.zst is closed"):
        reader.read_at(0, 4)


def test_pack_of_a_file_that_changes_publishes_nothing(tmp_path):
    write(tmp_path / "in", b"a" * 10_000)

    def grow(nbytes):
        with open(tmp_path / "in", "ab") as f:
            f.write(b"b")

    with pytest.raises(IntegrityError, match=r"in: size changed from 10000 to 10003 bytes while packing"):
        pack(str(tmp_path / "in"), str(tmp_path / "out.zst"), frame_nbytes=4000, progress=grow)
    only(tmp_path, "in")
    with pytest.raises(FileNotFoundError):
        pack(str(tmp_path / "missing"), str(tmp_path / "out.zst"))
    only(tmp_path, "in")


# ---------------------------------------------------------------- command line


def cli(*argv) -> int:
    return cli_main([str(a) for a in argv])


def test_cli_pack_unpack_extract_and_exit_codes(artifacts, tmp_path, capsysbinary):
    def output():
        captured = capsysbinary.readouterr()
        return captured.out.decode(errors="replace"), captured.err.decode()

    src = artifacts["ptd"]
    zst, out = tmp_path / "m.zst", tmp_path / "m.ptd"
    assert cli("pack", src, zst, "--frame-size", "1K", "-l", "9") == 0
    assert "ratio" in output()[0]
    assert cli("unpack", zst, out, "--json") == 0
    assert '"content xxh3-128"' in output()[0] and read(out) == read(src)
    assert cli("extract", zst, "l2.bias", "-o", tmp_path / "b.bin") == 0
    assert "decompressed 1 of 11 frames" in output()[0]
    assert cli("extract", zst, "--list") == 0
    assert "keys: l1.weight" in output()[0]
    assert cli("extract", zst, "--segment", "3") == 0
    captured = capsysbinary.readouterr()
    assert captured.out == read(tmp_path / "b.bin") == read(src)[-32:]
    assert b"extracted segment 3 (32 bytes at offset 9,856)" in captured.err
    assert cli("extract", zst, "nope") == 2
    assert "no key 'nope'" in output()[1]
    assert cli("extract", zst) == 2
    assert "give exactly one of KEY or --segment" in output()[1]
    assert cli("unpack", tmp_path / "missing.zst", out) == 2
    assert "No such file" in output()[1]
    write(tmp_path / "bad.zst", read(zst)[:-3])
    assert cli("unpack", tmp_path / "bad.zst", tmp_path / "x") == 1
    err = output()[1]
    assert "runs beyond the end of the file" in err and "truncated" in err
    only(tmp_path, "m.zst", "m.ptd", "b.bin", "bad.zst")


def test_parse_nbytes():
    assert [parse_nbytes(t) for t in ("8M", "8MiB", "512k", "1G", "4096")] == [
        8 << 20, 8 << 20, 512 << 10, 1 << 30, 4096]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_nbytes("lots")
