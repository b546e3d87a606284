"""WritebackWindows: which ranges go to disk, how much stays cached, and the thread's lifetime."""

import os
import threading

import pytest
from conftest import skip_unless_pages_can_drop

from ptdstream.system import pagecache, writeback
from ptdstream.system.pagecache import resident_nbytes
from ptdstream.system.writeback import WritebackWindows
from ptdstream.write.sink import ChunkedFileSink

MiB = 1 << 20


def _writeback_threads():
    return [t for t in threading.enumerate() if t.name == "ptdstream-writeback"]


@pytest.fixture
def calls(monkeypatch):
    """Record sync_file_range and drop calls instead of making them."""
    seen = []
    monkeypatch.setattr(writeback, "_sync_file_range",
                        lambda fd, start, n, flags: seen.append(("sync", start, start + n, flags)) or 0)
    monkeypatch.setattr(pagecache, "drop_pages", lambda fd, start, n: seen.append(("drop", start, start + n)))
    return seen


def test_windows_close_at_size_and_at_gaps_and_the_oldest_is_dropped(calls):
    wb = WritebackWindows(fd=-1, window_nbytes=4 * MiB, inflight=1)
    for offset in range(0, 8 * MiB, MiB):  # two full windows, front to back
        wb.written(offset, MiB)
    wb.written(20 * MiB, MiB)  # a gap: another rank's range lies between
    wb.written(30 * MiB, 2 * MiB)  # another gap closes [20, 21) MiB
    wb.close()
    write, wait = 2, 1 | 2 | 4
    assert calls == [
        ("sync", 0, 4 * MiB, write),
        ("sync", 4 * MiB, 8 * MiB, write),
        ("sync", 0, 4 * MiB, wait),
        ("drop", 0, 4 * MiB),
        ("sync", 20 * MiB, 21 * MiB, write),
        ("sync", 4 * MiB, 8 * MiB, wait),
        ("drop", 4 * MiB, 8 * MiB),
    ]  # [30, 32) MiB, the open window, is left to the caller's fsync


def test_close_stops_the_thread_and_is_idempotent(calls):
    before = len(_writeback_threads())
    wb = WritebackWindows(fd=-1, window_nbytes=MiB, inflight=2)
    for offset in range(0, 4 * MiB, MiB):
        wb.written(offset, MiB)
    assert len(_writeback_threads()) == before + 1
    wb.close()
    wb.close()
    assert len(_writeback_threads()) == before


def test_no_thread_when_no_window_closes(calls):
    before = len(_writeback_threads())
    wb = WritebackWindows(fd=-1, window_nbytes=64 * MiB)
    wb.written(0, MiB)
    assert len(_writeback_threads()) == before
    wb.close()
    assert calls == []


@pytest.mark.skipif(writeback._sync_file_range is None, reason="needs Linux sync_file_range")
def test_cached_bytes_stay_bounded_while_writing(tmp_path):
    skip_unless_pages_can_drop(tmp_path)
    window, inflight = MiB, 2
    bound = (inflight + 3) * window
    path = str(tmp_path / "out.bin")
    piece = os.urandom(MiB // 2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        wb = WritebackWindows(fd, window_nbytes=window, inflight=inflight)
        most = 0
        for i in range(96):
            os.pwrite(fd, piece, i * len(piece))
            wb.written(i * len(piece), len(piece))
            most = max(most, resident_nbytes(path))
        wb.close()
        os.fsync(fd)
    finally:
        os.close(fd)
    assert os.path.getsize(path) == 48 * MiB
    assert most <= bound, f"{most} bytes cached while writing, bound {bound}"


def test_a_sink_aborted_mid_write_stops_its_writeback_thread(tmp_path):
    before = len(_writeback_threads())
    sink = ChunkedFileSink(str(tmp_path / "x.ptd"), window_nbytes=MiB)
    for _ in range(8):
        sink.write(bytes(MiB))
    if writeback._sync_file_range is not None:
        assert len(_writeback_threads()) == before + 1
    sink.abort()
    assert len(_writeback_threads()) == before
    assert os.listdir(tmp_path) == []


def test_a_write_larger_than_a_window_is_sent_as_several(calls):
    wb = WritebackWindows(fd=-1, window_nbytes=MiB, inflight=8)
    wb.written(0, 3 * MiB + 5)
    wb.close()
    assert [c[1:3] for c in calls] == [(0, MiB), (MiB, 2 * MiB), (2 * MiB, 3 * MiB)]


def test_drops_start_at_the_2mib_block_that_holds_a_window_start(calls):
    """fadvise drops only whole folios (pages, or up to 2 MiB after a large write):
    a drop reaches back to the 2 MiB block its window starts in."""
    wb = WritebackWindows(fd=-1, window_nbytes=3 * MiB, inflight=1)
    wb.written(256, 9 * MiB)  # three windows from offset 256: none starts on a page
    wb.close()
    drops = [c[1:] for c in calls if c[0] == "drop"]
    assert drops == [(0, 256 + 3 * MiB), (2 * MiB, 256 + 6 * MiB)]


@pytest.mark.skipif(writeback._sync_file_range is None, reason="needs Linux sync_file_range")
def test_large_writes_into_small_windows_stay_bounded(tmp_path):
    """8 MiB writes (page-cache folios up to 2 MiB) into 1 MiB windows: dropping
    only each window's own range left every folio it shared (192 of 256 MiB cached)."""
    skip_unless_pages_can_drop(tmp_path)
    window, inflight, piece = MiB, 2, os.urandom(8 * MiB)
    path = str(tmp_path / "large.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    most = 0
    try:
        os.pwrite(fd, b"h" * 256, 0)
        wb = WritebackWindows(fd, window_nbytes=window, inflight=inflight)
        for i in range(12):
            os.pwrite(fd, piece, 256 + i * len(piece))
            wb.written(256 + i * len(piece), len(piece))
            most = max(most, resident_nbytes(path))
        wb.close()
    finally:
        os.close(fd)
    bound = (inflight + 3) * window + 2 * MiB + len(piece)
    assert most <= bound, f"{most} bytes cached, bound {bound}"


@pytest.mark.skipif(writeback._sync_file_range is None, reason="needs Linux sync_file_range")
def test_unaligned_windows_stay_bounded(tmp_path):
    """Windows that start inside a page (a .ptd's payload after its header) and a
    window that is not a page multiple: the cache stays within the bound."""
    skip_unless_pages_can_drop(tmp_path)
    for window in (64 << 10, 6000):
        inflight = 2
        path = str(tmp_path / f"out{window}.bin")
        piece = os.urandom(window)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        most = 0
        try:
            os.pwrite(fd, b"h" * 256, 0)
            wb = WritebackWindows(fd, window_nbytes=window, inflight=inflight)
            for i in range((16 * MiB) // window):
                os.pwrite(fd, piece, 256 + i * window)
                wb.written(256 + i * window, window)
                most = max(most, resident_nbytes(path))
            wb.close()
        finally:
            os.close(fd)
        bound = (inflight + 3) * (window + 2 * 4096) + window
        assert most <= bound, f"window {window}: {most} bytes cached, bound {bound}"
