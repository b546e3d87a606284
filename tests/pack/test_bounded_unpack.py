"""unpack decompresses in bounded pieces whatever the frame size, with every check."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import xxhash
import zstandard
from _procs import SAFETY_S

from ptdstream import IntegrityError
from ptdstream.pack import unpack
from ptdstream.pack.seek_table import encode_seek_table, frame_checksum


def one_frame_file(path, content: bytes, *, checksum=None, table_nbytes=None) -> None:
    """A seekable zstd file of one frame holding ``content``."""
    frame = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(content)
    entry = (len(frame), len(content) if table_nbytes is None else table_nbytes,
             frame_checksum(content) if checksum is None else checksum)
    with open(path, "wb") as f:
        f.write(frame + encode_seek_table([entry], checksums=True))


def test_a_large_frame_is_unpacked_in_pieces_with_its_checks(tmp_path):
    content = os.urandom(1000) * 3000  # 3 MB in one frame, pieces of 256 KiB
    one_frame_file(tmp_path / "x.zst", content)
    report = unpack(str(tmp_path / "x.zst"), str(tmp_path / "out"), piece_nbytes=256 << 10)
    assert (tmp_path / "out").read_bytes() == content
    assert report.checks == ("zstd frame checksums", "seek table checksums")


def test_a_bad_seek_table_checksum_of_a_large_frame_publishes_nothing(tmp_path):
    content = bytes(3 << 20)
    one_frame_file(tmp_path / "x.zst", content, checksum=0x12345678)
    with pytest.raises(IntegrityError, match="seek table checksum 0x12345678"):
        unpack(str(tmp_path / "x.zst"), str(tmp_path / "out"), piece_nbytes=256 << 10)
    assert sorted(os.listdir(tmp_path)) == ["x.zst"]


def test_a_1_gib_frame_of_zeros_unpacks_in_bounded_memory(tmp_path):
    """The frame is made by streaming (never 1 GiB in memory); the unpack runs in a
    child whose peak RSS is measured: it was 1.05 GB before pieces."""
    src = tmp_path / "zeros.zst"
    cctx = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True)
    zero = bytes(1 << 20)
    nbytes = 1 << 30
    h = xxhash.xxh64()
    with open(src, "wb") as f:
        with cctx.stream_writer(f, size=nbytes, closefd=False) as w:
            for _ in range(nbytes // len(zero)):
                w.write(zero)
                h.update(zero)
        frame_nbytes = f.tell()
        f.write(encode_seek_table([(frame_nbytes, nbytes, h.intdigest() & 0xFFFFFFFF)], checksums=True))
    assert os.path.getsize(src) < 100_000
    code = textwrap.dedent(f"""
        import resource, sys
        from ptdstream.pack import unpack
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        unpack({str(src)!r}, {str(tmp_path / 'out')!r})
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SAFETY_S)
    assert out.returncode == 0, out.stderr[-2000:]
    added_kib = int(out.stdout.split()[-1])
    assert added_kib < 128 << 10, f"peak RSS grew by {added_kib} KiB"
    assert os.path.getsize(tmp_path / "out") == nbytes
