"""Spill files: an unlinked temp file, bytes read back exactly, checked at the save."""

from __future__ import annotations

import errno
import gc
import os

import pytest
import xxhash
from conftest import skip_unless_pages_can_drop

from ptdstream import StreamingNamedDataStore
from ptdstream.errors import IntegrityError
from ptdstream.hooks.cuda import spill as spill_module
from ptdstream.hooks.cuda.spill import SPILL_ALIGNMENT, SpillFile
from ptdstream.save import write_data_files
from ptdstream.sources import BufferRing, MemorySource
from ptdstream.system.pagecache import resident_nbytes


def _read(source, chunk=1000):
    return b"".join(bytes(p) for p in source.pieces(BufferRing(chunk, count=2)))


def test_spilled_bytes_read_back_exactly_from_a_file_without_a_name(tmp_path):
    a, b = os.urandom(10_000), os.urandom(5)
    spill = SpillFile(str(tmp_path))
    first = spill.append(MemorySource(a), "storage a")
    second = spill.append(MemorySource(b), "storage b")
    assert os.listdir(tmp_path) == []  # O_TMPFILE, or created and removed at once
    assert (first.offset, second.offset) == (0, -(-10_000 // SPILL_ALIGNMENT) * SPILL_ALIGNMENT)
    assert (_read(first), _read(second, chunk=2)) == (a, b)
    assert (first.prefix(32), second.prefix(32)) == (a[:32], b)
    assert first.expectation.fingerprint.digest == xxhash.xxh3_128(a).digest()
    assert first.expectation.fingerprint.nbytes == 10_000
    assert "storage b, spilled to an unlinked temp file in " + str(tmp_path) + " at offset 12288" == second.describe()


def test_the_spill_file_is_closed_with_its_last_source(tmp_path):
    spill = SpillFile(str(tmp_path))
    fd = spill.fileno()
    source = spill.append(MemorySource(b"abc"), "s")
    del spill
    gc.collect()
    os.fstat(fd)  # the source keeps it open
    assert _read(source) == b"abc"
    del source
    gc.collect()
    with pytest.raises(OSError) as e:
        os.fstat(fd)
    assert e.value.errno == errno.EBADF


def test_a_failed_spill_names_folder_and_offset_and_leaves_earlier_ranges_readable(tmp_path, monkeypatch):
    spill = SpillFile(str(tmp_path))
    kept = spill.append(MemorySource(b"k" * 5000), "kept")
    real = spill_module.pwrite_all
    calls = []

    def full_disk(fd, view, offset):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, view, offset)

    monkeypatch.setattr(spill_module, "pwrite_all", full_disk)
    with pytest.raises(OSError, match=rf"big: spilling 3000 bytes to an unlinked temp file in {tmp_path} "
                                      r"at offset 9192 failed: No space left on device") as e:
        spill.append(MemorySource(b"x" * 3000), "big", chunk_nbytes=1000)
    assert e.value.errno == errno.ENOSPC
    assert _read(kept) == b"k" * 5000
    monkeypatch.setattr(spill_module, "pwrite_all", real)
    after = spill.append(MemorySource(b"y" * 10), "after")
    assert _read(after) == b"y" * 10 and _read(kept) == b"k" * 5000


def test_a_source_shorter_than_it_said_is_refused(tmp_path):
    class Short(MemorySource):
        def pieces(self, ring):
            yield memoryview(b"ab")

    with pytest.raises(IntegrityError, match=r"short: .* gave 2 bytes, not 5, when spilled to "):
        SpillFile(str(tmp_path)).append(Short(b"abcde"), "short")


def test_a_save_of_spilled_bytes_equals_the_save_of_the_bytes_and_refuses_them_changed(tmp_path):
    payload = {"w0": os.urandom(70_000), "w1": os.urandom(3)}
    spill = SpillFile(str(tmp_path))
    plain, spilled = StreamingNamedDataStore(), StreamingNamedDataStore()
    sources = {}
    for key, data in payload.items():
        plain.add_named_data(key, data, alignment=64, external_tag="w")
        sources[key] = spill.append(MemorySource(data), f"storage of {key}")
        spilled.add_named_data(key, sources[key], alignment=64, external_tag="w")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_data_files(plain, str(tmp_path / "a"))
    write_data_files(spilled, str(tmp_path / "b"))
    assert (tmp_path / "b" / "w.ptd").read_bytes() == (tmp_path / "a" / "w.ptd").read_bytes()

    os.pwrite(spill.fileno(), bytes([payload["w0"][50_000] ^ 0xFF]), sources["w0"].offset + 50_000)  # changed under it
    again = StreamingNamedDataStore()
    again.add_named_data("w0", sources["w0"], alignment=64, external_tag="w")
    (tmp_path / "c").mkdir()
    with pytest.raises(IntegrityError, match=r"w0.*storage of w0, spilled to an unlinked temp file .* changed "
                                             r"after it was handed over"):
        write_data_files(again, str(tmp_path / "c"))
    assert os.listdir(tmp_path / "c") == []


def test_spilling_and_reading_back_leave_little_of_the_file_in_the_page_cache(tmp_path):
    skip_unless_pages_can_drop(tmp_path)
    spill = SpillFile(str(tmp_path), window_nbytes=1 << 20)
    source = spill.append(MemorySource(os.urandom(48 << 20)), "big", chunk_nbytes=1 << 20)
    proc = f"/proc/self/fd/{spill.fileno()}"
    after_spill = resident_nbytes(proc)
    for _ in source.pieces(BufferRing(1 << 20, count=2)):
        pass
    after_read = resident_nbytes(proc)
    # Nothing once spilled (written back, then dropped); a read-ahead still in
    # flight at its drop after reading (it was 14-18 MiB of 48 before drop_read).
    assert after_spill <= 2 << 20, after_spill
    assert after_read <= 6 << 20, after_read
