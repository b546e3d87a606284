"""ChunkedFileSink: pieces, short writes, faults, atomic publish, nothing left behind."""

from __future__ import annotations

import errno
import os

import pytest
from conftest import skip_unless_pages_can_drop

from ptdstream import ChunkedFileSink, StateError
from ptdstream.write.sink_protocol import SinkState
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
    skip_unless_pages_can_drop(tmp_path)
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
    chunks = [c[:n] for c, n in zip(chunks, sizes, strict=True)]
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


def _count_folder_steps(monkeypatch):
    """Record each folder-recovery call (``journal.clean_folder``): its folder and
    the ptdstream temp files there at that moment."""
    from ptdstream.write import journal
    from ptdstream.write import sink as sink_module
    from ptdstream.write.tempfiles import temp_files_in

    calls = []
    real = journal.clean_folder

    def counting(folder):
        folder = os.path.abspath(folder)
        calls.append((folder, sorted(os.path.basename(p) for p, _, _ in temp_files_in(folder))))
        return real(folder)

    monkeypatch.setattr(journal, "clean_folder", counting)
    monkeypatch.setattr(sink_module, "clean_folder", counting, raising=False)  # where a sink bound it
    return calls


def _dead_writers_temp(folder, name="model.pte"):
    """A leftover of a killed writer (unlocked ``.tmp``), which the folder step removes."""
    path = folder / f".{name}.ptdstream-999999-0badf00d.tmp"
    path.write_bytes(b"leftover")
    return path.name


def test_save_recovers_each_folder_once_before_its_temp_files(tmp_path, monkeypatch):
    from conftest import Mlp, export, reference_files
    from executorch.exir import ExecutorchBackendConfig

    import ptdstream

    manager = export(Mlp(), config=ExecutorchBackendConfig(external_constants=True))
    ref = reference_files(manager, str(tmp_path / "ref"))
    pte_dir, ptd_dir = tmp_path / "pte", tmp_path / "ptd"
    pte_dir.mkdir()
    ptd_dir.mkdir()
    stale = [_dead_writers_temp(pte_dir), _dead_writers_temp(ptd_dir, "model.ptd")]
    calls = _count_folder_steps(monkeypatch)
    ptdstream.save(manager, str(pte_dir / "model.pte"), data_dir=str(ptd_dir), manifest=True)
    # One step per folder, each before any temp file of this save existed.
    assert sorted(calls) == sorted([(str(pte_dir), [stale[0]]), (str(ptd_dir), [stale[1]])])
    assert sorted(os.listdir(pte_dir)) == ["model.manifest", "model.pte"]
    assert (pte_dir / "model.pte").read_bytes() == ref["model.pte"]
    assert {n: (ptd_dir / n).read_bytes() for n in os.listdir(ptd_dir)} == {
        n: b for n, b in ref.items() if n.endswith(".ptd")}


def test_write_data_files_recovers_its_folder_once_for_several_files(tmp_path, monkeypatch):
    from ptdstream import StreamingNamedDataStore
    from ptdstream.save import write_data_files

    store = StreamingNamedDataStore()
    store.add_named_data("a", b"\x01" * 1000, alignment=16, external_tag="w")
    store.add_named_data("b", b"\x02" * 3000, alignment=16, external_tag="x")
    stale = _dead_writers_temp(tmp_path, "w.ptd")
    calls = _count_folder_steps(monkeypatch)
    reports = write_data_files(store, str(tmp_path))
    assert calls == [(str(tmp_path), [stale])]
    assert sorted(os.listdir(tmp_path)) == ["w.ptd", "x.ptd"]
    assert [os.path.getsize(r.path) for r in reports] == [r.nbytes for r in reports]


def test_a_sink_on_its_own_recovers_its_folder_once_and_skips_it_when_told(tmp_path, monkeypatch):
    stale = _dead_writers_temp(tmp_path, "a.bin")
    calls = _count_folder_steps(monkeypatch)
    with ChunkedFileSink(str(tmp_path / "b.bin"), clean_folder=False) as sink:
        sink.write(b"set-level")
    assert calls == []
    assert sorted(os.listdir(tmp_path)) == sorted(["b.bin", stale])  # the leftover stays
    with ChunkedFileSink(str(tmp_path / "a.bin")) as sink:
        sink.write(b"alone")
    assert calls == [(str(tmp_path), [stale])]
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "b.bin"]
    assert (tmp_path / "a.bin").read_bytes() == b"alone"
