"""Temp files: every writer removes dead writers' leftovers the same way, and a
live writer's temp file is kept whatever PID namespace it runs in (flock, not pid)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import Mlp, export
from executorch.exir import ExecutorchBackendConfig

import ptdstream
from ptdstream import ChunkedFileSink
from ptdstream.manifest.describe import write_manifest
from ptdstream.pack import PackedArtifact, pack, unpack
from ptdstream.write import tempfiles
from ptdstream.write.publish import remove_stale_temp_files

DEAD_PID = 999_999_999  # no such process


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved model (.pte + .ptd) and its packed .ptd, in a folder of their own."""
    folder = tmp_path_factory.mktemp("saved")
    torch.manual_seed(0)
    manager = export(Mlp(), config=ExecutorchBackendConfig(external_constants=True))
    ptdstream.save(manager, str(folder / "model.pte"))
    ptd = folder / "_default_external_constant.ptd"
    pack(str(ptd), str(folder / "w.ptd.zst"))
    return manager, folder


def plant(folder, name: str) -> list:
    """Leftovers of a killed writer for ``name`` and for an unrelated file."""
    paths = []
    for target, suffix in ((name, "tmp"), (name, "bak"), ("other.bin", "tmp")):
        p = folder / f".{target}.ptdstream-{DEAD_PID}-0badf00d.{suffix}"
        p.write_bytes(b"left by a killed writer")
        paths.append(p)
    return paths


WRITERS = {
    "save": lambda m, src, out: ptdstream.save(m, str(out / "model.pte")),
    "pack": lambda m, src, out: pack(str(src / "model.pte"), str(out / "model.pte")),
    "unpack": lambda m, src, out: unpack(str(src / "w.ptd.zst"), str(out / "model.pte")),
    "extract": lambda m, src, out: PackedArtifact(str(src / "w.ptd.zst")).extract(
        str(out / "model.pte"), index=0),
    "manifest": lambda m, src, out: write_manifest([str(src / "model.pte")], str(out / "model.pte")),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_writer_removes_dead_writers_temp_files(saved, tmp_path, writer):
    manager, src = saved
    out = tmp_path / "out"
    out.mkdir()
    left = plant(out, "model.pte")
    WRITERS[writer](manager, src, out)
    assert not any(p.exists() for p in left), [p.name for p in left if p.exists()]
    assert not any(n.startswith(".") for n in os.listdir(out)), os.listdir(out)


def test_remove_stale_temp_files_keeps_locked_ones(tmp_path):
    target = str(tmp_path / "a.bin")
    live, fd, lock_fd = tempfiles.create_locked(target)
    os.close(fd)
    plant(tmp_path, "a.bin")
    try:
        remove_stale_temp_files(target)
        assert sorted(os.listdir(tmp_path)) == [os.path.basename(live)]
    finally:
        os.close(lock_fd)
        os.unlink(live)


def test_temp_names_of_long_targets_stay_under_name_max(tmp_path):
    name = "x" * 250
    path, fd, lock_fd = tempfiles.create_locked(str(tmp_path / name))
    os.close(fd)
    os.close(lock_fd)
    base = os.path.basename(path)
    assert len(base.encode()) <= 255
    assert tempfiles.parse_name(base) == (tempfiles.stem(name), "tmp")


_NAMESPACED_WRITER = textwrap.dedent(
    """
    import sys
    from ptdstream import ChunkedFileSink
    sink = ChunkedFileSink(sys.argv[1])
    sink.write(b"written in another PID namespace")
    print(sink.temp_path, flush=True)
    sys.stdin.readline()
    sink.commit()
    print("published", flush=True)
    """
)


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare --pid` (root, util-linux)")
def test_a_save_in_another_pid_namespace_is_not_taken_for_stale(tmp_path):
    """The writer runs in a new PID namespace with a pid that does not exist here:
    a pid test would call its temp file stale; its lock says it is alive."""
    target = tmp_path / "model.pte"
    inner = (
        'echo 3999990 > /proc/sys/kernel/ns_last_pid 2>/dev/null; "$0" -c "$1" "$2"'
    )
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", inner, sys.executable,
         _NAMESPACED_WRITER, str(target)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        temp = proc.stdout.readline().strip()
        assert os.path.exists(temp), temp
        pid = int(os.path.basename(temp).rsplit(".ptdstream-", 1)[1].split("-")[0])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            pass  # no such pid here
        else:  # ns_last_pid refused 3999990 (above a pid_max of 32768 shared with this namespace)
            pytest.skip(f"the writer's pid in its namespace, {pid}, is a live process here too")
        # Two other writers into the same folder clean it first; the temp stays.
        with ChunkedFileSink(str(tmp_path / "other.pte")) as sink:
            sink.write(b"x")
        remove_stale_temp_files(str(target))
        assert os.path.exists(temp)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "published"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert target.read_bytes() == b"written in another PID namespace"
    assert sorted(os.listdir(tmp_path)) == ["model.pte", "other.pte"]


# Every byte a file name may hold (all but NUL and "/") round-trips through the naming rule.
_ANY_BYTE_NAMES = [b"m" + bytes([i]) + b".pte" for i in range(1, 256) if i != ord("/")]


@pytest.mark.parametrize("suffix", ["tmp", "bak", "journal"])
def test_every_byte_of_a_name_round_trips_through_the_naming_rule(tmp_path, suffix):
    for raw in _ANY_BYTE_NAMES + [b"\n", b"a\nb\n", b"\xff" * 200, "é".encode() * 100]:
        name = os.fsdecode(raw)
        temp = tempfiles.temp_name_for(str(tmp_path / name), suffix)
        assert os.path.dirname(temp) == str(tmp_path)
        assert tempfiles.parse_name(os.path.basename(temp)) == (tempfiles.stem(name), suffix), raw
        assert len(os.fsencode(os.path.basename(temp))) <= 255


def test_a_newline_names_leftovers_that_are_found_and_removed(tmp_path):
    target = str(tmp_path / "model\n.pte")
    temp, fd, lock_fd = tempfiles.create_locked(target)
    os.close(fd)
    os.close(lock_fd)
    assert [p for p, _, _ in tempfiles.temp_files_in(str(tmp_path))] == [temp]
    assert tempfiles.stale_temp_files(target) == [temp]
