"""ptdstream's packs against pyzstd's ``SeekableZstdFile`` (the same standard seekable
zstd format): what interoperates, and the probes that keep ptdstream's own reader
and writer (a hostile seek table, a frame header's content size, the seek table's
checksums and the content frame are checked by ptdstream, not by pyzstd)."""

from __future__ import annotations

import io
import os
import random
import struct
import subprocess
import sys
import textwrap

import pytest
import zstandard
from _procs import SAFETY_S
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptdstream import FormatError, IntegrityError
from ptdstream.format.identity import FlatTensorHeader
from ptdstream.pack import pack, plan_frames, unpack
from ptdstream.pack.seek_table import encode_seek_table
from ptdstream.pack.seekable import SeekableReader

pyzstd = pytest.importorskip("pyzstd")
SeekableZstdFile = pyzstd.SeekableZstdFile


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def ptd_like(nbytes: int, seed: int = 0) -> bytes:
    """A .ptd head (its flatbuffer ends at byte 1000: ptdstream cuts a frame there),
    then runs and random bytes."""
    rng = random.Random(seed)
    head = b"\0" * 4 + b"FT01" + FlatTensorHeader(48, 952, 1024, max(0, nbytes - 1024)).to_bytes()
    body = b"".join(bytes([i % 256]) * 500 + rng.randbytes(500) for i in range(nbytes // 1000 + 1))
    return (head + body)[:nbytes]


def entries(packed: bytes):
    """``(descriptor, [(compressed_nbytes, nbytes)])`` of a seek table, parsed here."""
    count, descriptor, _ = struct.unpack_from("<IBI", packed, len(packed) - 9)
    size = 12 if descriptor & 0x80 else 8
    table = len(packed) - (8 + count * size + 9)
    return descriptor, [struct.unpack_from("<II", packed, table + 8 + i * size) for i in range(count)]


def pyzstd_pack(data: bytes, cuts, option=None) -> bytes:
    """pyzstd's seekable file of ``data``, one frame per ``(offset, nbytes)`` of ``cuts``."""
    opt = {pyzstd.CParameter.compressionLevel: 3, pyzstd.CParameter.checksumFlag: 1, **(option or {})}
    buf = io.BytesIO()
    with SeekableZstdFile(buf, "w", level_or_option=opt) as f:
        for offset, n in cuts:
            f.write(data[offset : offset + n])
            f.flush(f.FLUSH_FRAME)
    return buf.getvalue()


# ---------------------------------------------------------------- what interoperates


@pytest.mark.parametrize("nbytes,frame_nbytes,checksums,threads", [
    (0, 4096, True, 1), (999, 4096, True, 1), (20_000, 4096, True, 2), (20_000, 4096, False, 1),
    (70_001, 8192, True, 3)])
def test_pyzstd_reads_every_pack_ptdstream_writes_at_every_frame_boundary(tmp_path, nbytes, frame_nbytes,
                                                                        checksums, threads):
    data = ptd_like(nbytes)
    (tmp_path / "in.ptd").write_bytes(data)
    report = pack(str(tmp_path / "in.ptd"), str(tmp_path / "in.zst"), frame_nbytes=frame_nbytes,
                  checksums=checksums, threads=threads)
    cuts = plan_frames(nbytes, frame_nbytes, report.head_nbytes)
    assert nbytes < 1000 or (0, 1000) in cuts  # the metadata cut is there
    with SeekableZstdFile(str(tmp_path / "in.zst")) as f:
        assert f.read() == data
        assert f.seek(0, os.SEEK_END) == nbytes
        for offset, n in reversed(cuts):
            assert f.seek(offset) == offset
            assert f.read(n) == data[offset : offset + n]
            f.seek(offset + n // 2)
            assert f.read(7) == data[offset + n // 2 : offset + n // 2 + 7]
        last = cuts[-1][0] if cuts else 0
        f.seek(last)  # then through the content frame (skippable, size 0 in the table) to the end
        assert f.read() == data[last:]


def test_ptdstream_reads_pyzstd_files_with_ptdstreams_frame_boundaries(tmp_path):
    data = ptd_like(30_000, seed=1)
    cuts = plan_frames(len(data), 4096, 1000)
    (tmp_path / "py.zst").write_bytes(pyzstd_pack(data, cuts))
    report = unpack(str(tmp_path / "py.zst"), str(tmp_path / "out"))
    assert read(tmp_path / "out") == data and report.frames == len(cuts)
    # zstd's own frame checksums only: pyzstd writes no seek table checksums, no manifest.
    assert report.checks == ("zstd frame checksums",)
    with SeekableReader(str(tmp_path / "py.zst")) as reader:
        assert [(e.offset, e.nbytes) for e in reader.table.frames] == cuts
        assert reader.content is None
        for offset, n in cuts:
            assert reader.read_at(offset, n) == data[offset : offset + n]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=st.binary(max_size=300), table=st.lists(st.tuples(st.integers(0, 2**32 - 1),
       st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)), max_size=6),
       count_delta=st.integers(-2, 2), descriptor=st.sampled_from([0, 0x80, 0x81, 0x84]))
def test_pyzstd_refuses_every_random_seek_table_with_its_format_error(prefix, table, count_delta, descriptor):
    """The tables of ptdstream's fuzz test: pyzstd checks the count against the file
    size before it reads the table, and the frames' sizes against the file size:
    each is refused with its own errors (or is an empty file), never more."""
    fmt = "<III" if descriptor & 0x80 else "<II"
    body = b"".join(struct.pack(fmt, *e[: len(fmt) - 1]) for e in table)
    count = max(0, len(table) + count_delta)
    data = (prefix + struct.pack("<II", 0x184D2A5E, len(body) + 9) + body
            + struct.pack("<IBI", count, descriptor, 0x8F92EAB1))
    try:
        with SeekableZstdFile(io.BytesIO(data)) as f:
            assert f.read() == b""
    except (pyzstd.SeekableFormatError, pyzstd.ZstdError):
        pass


def test_both_write_to_a_non_seekable_stream_only_pyzstd_refuses_to_read_one(tmp_path):
    class Pipe(io.RawIOBase):  # a write/read end that cannot seek, like stdout or stdin
        def __init__(self, data=b""):
            self.data, self.at = bytearray(data), 0
        def writable(self):
            return True

        def readable(self):
            return True

        def seekable(self):
            return False

        def write(self, b):
            self.data += b
            return len(b)

        def readinto(self, b):
            n = min(len(b), len(self.data) - self.at)
            b[:n] = self.data[self.at : self.at + n]
            self.at += n
            return n

    data = ptd_like(20_000)
    (tmp_path / "in.ptd").write_bytes(data)
    ours, theirs = Pipe(), Pipe()
    pack(str(tmp_path / "in.ptd"), ours, frame_nbytes=4096)
    with SeekableZstdFile(theirs, "w", max_frame_content_size=4096) as f:
        f.write(data)
    (tmp_path / "ours.zst").write_bytes(bytes(ours.data))
    assert read(tmp_path / "ours.zst") == read(pack(str(tmp_path / "in.ptd"), str(tmp_path / "file.zst"),
                                                    frame_nbytes=4096).target)
    (tmp_path / "theirs.zst").write_bytes(bytes(theirs.data))
    unpack(str(tmp_path / "theirs.zst"), str(tmp_path / "out"))
    assert read(tmp_path / "out") == data
    with pytest.raises(TypeError, match="should be seekable"):
        SeekableZstdFile(Pipe(ours.data))


# ---------------------------------------------------------------- what pyzstd does not do (why pack/ stays)


def test_pyzstd_writer_has_no_seek_table_checksums_and_no_frame_content_size():
    """Same cuts, level and frame checksums as ptdstream: pyzstd's table has 8-byte
    entries (descriptor 0) and its streamed frames carry no content size, so the
    bytes differ from ptdstream's (which stores both)."""
    data = ptd_like(20_000)
    cuts = plan_frames(len(data), 4096, 1000)
    theirs = pyzstd_pack(data, cuts, {pyzstd.CParameter.contentSizeFlag: 1})
    descriptor, table = entries(theirs)
    assert descriptor == 0 and [d for _, d in table] == [n for _, n in cuts]
    assert theirs[4] & 0xC0 == 0 and not theirs[4] & 0x20  # frame header: no content size field
    cctx = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True)
    ours = b"".join(cctx.compress(data[o : o + n]) for o, n in cuts)
    assert ours[4] & 0x20 and theirs[: len(ours)] != ours


def test_pyzstd_does_not_check_seek_table_checksums(tmp_path):
    data = ptd_like(20_000)
    (tmp_path / "in.ptd").write_bytes(data)
    packed = bytearray(read(pack(str(tmp_path / "in.ptd"), str(tmp_path / "p.zst"), frame_nbytes=4096).target))
    count = struct.unpack_from("<I", packed, len(packed) - 9)[0]
    packed[len(packed) - 9 - 12 * count + 8] ^= 1  # frame 0's seek table checksum
    (tmp_path / "p.zst").write_bytes(packed)
    with SeekableZstdFile(str(tmp_path / "p.zst")) as f:
        assert f.read() == data  # not noticed
    with pytest.raises(IntegrityError, match=r"p\.zst: frame 0 at offset 0 .* seek table checksum 0x"):
        unpack(str(tmp_path / "p.zst"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("delta", [1, -1])
def test_pyzstd_seeks_to_wrong_bytes_when_a_seek_table_size_disagrees_with_its_frame(tmp_path, delta):
    data = random.Random(2).randbytes(20_000)
    (tmp_path / "in").write_bytes(data)
    packed = bytearray(read(pack(str(tmp_path / "in"), str(tmp_path / "p.zst"), frame_nbytes=4096).target))
    count = struct.unpack_from("<I", packed, len(packed) - 9)[0]
    at = len(packed) - 9 - 12 * count + 4  # frame 0's decompressed size
    struct.pack_into("<I", packed, at, 4096 + delta)
    (tmp_path / "p.zst").write_bytes(packed)
    with SeekableZstdFile(str(tmp_path / "p.zst")) as f:
        assert f.seek(0, os.SEEK_END) == 20_000 + delta
        f.seek(5000)
        assert f.read(100) == data[5000 - delta : 5100 - delta]  # silently shifted
    with pytest.raises(FormatError, match=r"p\.zst: frame 5 at offset \d+ .*manifest says 20000 content bytes"):
        SeekableReader(str(tmp_path / "p.zst"))


def test_pyzstd_seek_into_a_large_frame_allocates_what_it_skips(tmp_path):
    """A 256 MiB frame of zeros in a few KB: seeking to its end makes pyzstd hold
    the skipped bytes (its peak RSS grew by about 512 MiB); ptdstream's reader
    decodes in 8 MiB pieces."""
    src = tmp_path / "zeros.zst"
    nbytes = 256 << 20
    cctx = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True)
    with open(src, "wb") as f:
        with cctx.stream_writer(f, size=nbytes, closefd=False) as w:
            for _ in range(256):
                w.write(bytes(1 << 20))
        frame = f.tell()
        f.write(encode_seek_table([(frame, nbytes, 0)], checksums=False))
    assert os.path.getsize(src) < 100_000
    code = textwrap.dedent(f"""
        import sys
        import pyzstd
        from ptdstream.pack.seekable import SeekableReader

        def peak_kib():  # this process's own peak (ru_maxrss would carry the parent's over exec)
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

        base = peak_kib()
        if sys.argv[1] == "pyzstd":
            with pyzstd.SeekableZstdFile({str(src)!r}) as f:
                f.seek({nbytes - 16})
                tail = f.read(16)
        else:
            with SeekableReader({str(src)!r}) as r:
                tail = r.read_at({nbytes - 16}, 16)
        assert tail == bytes(16)
        print(peak_kib() - base)
    """)
    added = {}
    for who in ("pyzstd", "ptdstream"):
        out = subprocess.run([sys.executable, "-c", code, who], capture_output=True, text=True, timeout=SAFETY_S)
        assert out.returncode == 0, out.stderr[-2000:]
        added[who] = int(out.stdout.split()[-1])
    assert added["pyzstd"] > 256 << 10, added
    assert added["ptdstream"] < 48 << 10, added
