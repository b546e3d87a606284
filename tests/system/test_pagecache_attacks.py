"""brk2 probes of pagecache.drop_read (claim 2) and files.pwrite_all (claim 3)."""

from __future__ import annotations

import os

import pytest
from conftest import skip_unless_pages_can_drop

from ptdstream.check.compare import compare_files
from ptdstream.sources import BufferRing
from ptdstream.sources.file import FileRangeSource
from ptdstream.system import files as files_module
from ptdstream.system.files import pwrite_all
from ptdstream.system.pagecache import FOLIO_NBYTES, READAHEAD_NBYTES, drop_pages, drop_read, resident_nbytes

LIMIT = READAHEAD_NBYTES + FOLIO_NBYTES


def _cold_file(path, nbytes, seed=b""):
    with open(path, "wb") as f:
        f.write(seed + os.urandom(nbytes - len(seed)))
        f.flush()
        os.fsync(f.fileno())
        drop_pages(f.fileno(), 0, 0)
    assert resident_nbytes(str(path)) == 0
    return path


@pytest.mark.parametrize("chunk", [4096, 64 << 10, (1 << 20) + 1, 3 << 20, 12 << 20])
@pytest.mark.parametrize("offset,length", [(0, None), (4097, 20 << 20), ((2 << 20) - 1, (17 << 20) + 3)])
def test_brk2_file_range_read_leaves_at_most_10_mib(tmp_path, chunk, offset, length):
    skip_unless_pages_can_drop(tmp_path)
    path = _cold_file(tmp_path / "f", 32 << 20)
    src = FileRangeSource(str(path), offset, length)
    seen = bytearray()
    worst = 0
    for i, piece in enumerate(src.pieces(BufferRing(chunk, count=2))):
        seen += piece
        if i % 7 == 0:
            worst = max(worst, resident_nbytes(str(path)) - len(piece))
    after = resident_nbytes(str(path))
    with open(path, "rb") as f:
        f.seek(offset)
        expect = f.read(src.nbytes)
    assert bytes(seen) == expect
    assert after <= LIMIT, (after, worst)


def test_brk2_drop_read_keeps_dirty_bytes(tmp_path):
    path = tmp_path / "d"
    data = bytearray(os.urandom(6 << 20))
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        patch = os.urandom(3 << 20)
        os.pwrite(fd, patch, 1 << 20)  # dirty, not synced
        data[1 << 20:(1 << 20) + len(patch)] = patch
        for off in range(0, 6 << 20, 1 << 20):
            drop_read(fd, off, 1 << 20, last=off == 5 << 20)
        drop_pages(fd, 0, 0)
        assert os.pread(fd, 6 << 20, 0) == bytes(data)
    finally:
        os.close(fd)


def test_brk2_compare_files_leaves_at_most_10_mib(tmp_path):
    skip_unless_pages_can_drop(tmp_path)
    a = _cold_file(tmp_path / "a", 24 << 20)
    b = tmp_path / "b"
    b.write_bytes(a.read_bytes())
    with open(b, "rb+") as f:
        os.fsync(f.fileno())
        drop_pages(f.fileno(), 0, 0)
    with open(a, "rb") as f:
        drop_pages(f.fileno(), 0, 0)
    report = compare_files(str(a), str(b), chunk_nbytes=(3 << 20) + 5)
    assert report.ok
    assert resident_nbytes(str(a)) <= LIMIT and resident_nbytes(str(b)) <= LIMIT, (
        resident_nbytes(str(a)), resident_nbytes(str(b)))


def test_brk2_pwrite_all_loops_on_short_writes(tmp_path, monkeypatch):
    real = os.pwrite

    def one_byte(fd, view, offset):
        return real(fd, bytes(memoryview(view)[:1]), offset) if len(view) else 0

    monkeypatch.setattr(files_module.os, "pwrite", one_byte)
    path = tmp_path / "p"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        data = os.urandom(3000)
        assert pwrite_all(fd, memoryview(data), 10) == 3000
        import array
        arr = array.array("i", range(100))
        assert pwrite_all(fd, memoryview(arr), 5000) == 400
    finally:
        os.close(fd)
    raw = path.read_bytes()
    assert raw[10:3010] == data and raw[5000:5400] == arr.tobytes()


def test_brk2_pwrite_all_does_not_spin_forever_when_pwrite_writes_nothing(tmp_path, monkeypatch):
    """A pwrite that returns 0 for a non-empty buffer (some FUSE file systems): pwrite_all
    retries forever instead of raising."""
    calls = []

    def zero(fd, view, offset):
        calls.append(offset)
        if len(calls) > 1000:
            raise RuntimeError("pwrite_all called pwrite 1000 times with no progress")
        return 0

    monkeypatch.setattr(files_module.os, "pwrite", zero)
    fd = os.open(tmp_path / "z", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(OSError):
            pwrite_all(fd, memoryview(b"abc"), 0)
    finally:
        os.close(fd)
