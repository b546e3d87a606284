"""ChunkedFileSink: pieces, short writes, faults, atomic publish, nothing left behind."""

from __future__ import annotations

import errno
import os

import pytest

from ptdstream import ChunkedFileSink, StateError
from ptdstream.write.sink import SinkState
from ptdstream.write.tempfiles import stale_temp_files


def test_commit_publishes_exact_bytes_and_leaves_no_temp(tmp_path):
    target = tmp_path / "a.ptd"
    with ChunkedFileSink(str(target), window_nbytes=1 << 16) as sink:
        for i in range(40):
            sink.write(bytes([i]) * 10_000)
        sink.write_zeros(3_000_000)
    data = target.read_bytes()
    assert data == b"".join(bytes([i]) * 10_000 for i in range(40)) + bytes(3_000_000)
    assert os.listdir(tmp_path) == ["a.ptd"]
    assert sink.state is SinkState.COMMITTED


def test_short_writes_are_looped(tmp_path):
    calls = []

    def short_write(fd, view):
        calls.append(len(view))
        return os.write(fd, view[: max(1, len(view) // 3)])

    target = tmp_path / "a.bin"
    with ChunkedFileSink(str(target), write_fn=short_write) as sink:
        sink.write(b"0123456789" * 100)
    assert target.read_bytes() == b"0123456789" * 100
    assert len(calls) > 5


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_write_error_aborts_and_keeps_existing_target(tmp_path, code):
    target = tmp_path / "model.pte"
    target.write_bytes(b"previous complete file")
    written = []

    def failing_write(fd, view):
        if written:
            raise OSError(code, os.strerror(code))
        written.append(len(view))
        return os.write(fd, view)

    with pytest.raises(OSError) as err:
        with ChunkedFileSink(str(target), write_fn=failing_write) as sink:
            sink.write(b"a" * 100)
            sink.write(b"b" * 100)
    assert err.value.errno == code
    assert "at offset 100" in str(err.value) and str(target) in str(err.value)
    assert target.read_bytes() == b"previous complete file"
    assert os.listdir(tmp_path) == ["model.pte"]


def test_zero_length_write_result_is_an_error(tmp_path):
    with pytest.raises(OSError, match="write returned 0"):
        with ChunkedFileSink(str(tmp_path / "x"), write_fn=lambda fd, v: 0) as sink:
            sink.write(b"abc")
    assert os.listdir(tmp_path) == []


def test_exception_inside_with_aborts(tmp_path):
    with pytest.raises(RuntimeError):
        with ChunkedFileSink(str(tmp_path / "x")) as sink:
            sink.write(b"partial")
            raise RuntimeError("source failed")
    assert os.listdir(tmp_path) == []
    sink.abort()  # idempotent


def test_methods_check_state(tmp_path):
    sink = ChunkedFileSink(str(tmp_path / "x"))
    sink.write(b"abc")
    sink.commit()
    with pytest.raises(StateError, match="expected state open or writing, but it is committed"):
        sink.write(b"more")
    with pytest.raises(StateError):
        sink.publish()


def test_unwritable_folder_creates_nothing(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if os.access(str(folder), os.W_OK):
            pytest.skip("running as a user that ignores permissions")
        with pytest.raises(PermissionError):
            ChunkedFileSink(str(folder / "x"))
    finally:
        folder.chmod(0o700)
    assert os.listdir(folder) == []


def test_stale_temp_files_of_dead_processes_are_found(tmp_path):
    target = tmp_path / "model.pte"
    dead = tmp_path / ".model.pte.ptdstream-999999999-abcd1234.tmp"
    dead.write_bytes(b"x")
    live = ChunkedFileSink(str(target))
    try:
        assert not dead.exists()  # every writer removes dead writers' temp files first
        dead.write_bytes(b"x")
        assert stale_temp_files(str(target)) == [str(dead)]
        assert os.path.exists(live.temp_path)
    finally:
        live.abort()
    assert sorted(os.listdir(tmp_path)) == [dead.name]


def test_pages_are_dropped_after_sync(tmp_path):
    from ptdstream.system.pagecache import resident_nbytes

    target = tmp_path / "big.bin"
    plain = tmp_path / "plain.bin"
    with open(plain, "wb") as f:
        f.write(b"\x01" * (64 << 20))
    with ChunkedFileSink(str(target), window_nbytes=4 << 20) as sink:
        for _ in range(16):
            sink.write(b"\x01" * (4 << 20))
    assert resident_nbytes(str(plain)) > 32 << 20, "a plain write stays cached"
    assert resident_nbytes(str(target)) <= 8 << 20, "ptdstream's output does not"


def test_temp_names_of_long_targets_stay_under_name_max(tmp_path):
    target = tmp_path / ("p" * 250 + ".pte")
    with ChunkedFileSink(str(target)) as sink:
        assert len(os.path.basename(sink.temp_path)) < 255
        sink.write(b"data")
    assert target.read_bytes() == b"data"
    assert os.listdir(tmp_path) == [target.name]


@pytest.mark.parametrize("sizes", [[1], [4096], [8 << 20], [777_777] * 30 + [5], [0, 3, (8 << 20) + 1]])
def test_direct_writes_give_the_same_bytes(tmp_path, sizes):
    import random

    rng = random.Random(len(sizes))
    chunks = [bytes(rng.getrandbits(8) for _ in range(min(n, 64))) * (n // 64 + 1) for n in sizes]
    chunks = [c[:n] for c, n in zip(chunks, sizes)]
    target = tmp_path / "d.bin"
    with ChunkedFileSink(str(target), direct=True) as sink:
        for c in chunks:
            sink.write(c)
        sink.write_zeros(10)
    assert target.read_bytes() == b"".join(chunks) + bytes(10)
    assert os.listdir(tmp_path) == ["d.bin"]


def test_direct_falls_back_where_refused(tmp_path, monkeypatch):
    import fcntl

    real = fcntl.fcntl

    def refuse(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", refuse)
    target = tmp_path / "b.bin"
    with ChunkedFileSink(str(target), direct=True) as sink:
        assert sink.direct is False
        sink.write(b"buffered")
    assert target.read_bytes() == b"buffered"
