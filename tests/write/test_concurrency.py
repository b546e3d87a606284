"""Two processes saving into one folder, and a process reading while saves replace files.

The two saves are of two different small models ("A" and "B": every file of one
differs from the other's). Each round starts both saves at the same instant
(forked children released by one pipe). Half of the rounds go through
``ptdstream.save`` as is; the other half through ``write_save_plan`` with a sink
whose publish first waits a random 0-30 ms, as a slow folder fsync would, so
that the two saves' renames interleave unless the publish step is serialised.

After every round each file must equal one save's file (A's or B's, byte for
byte, as upstream writes it), and the .pte and the .ptd must come from the same
save.
"""

from __future__ import annotations

import collections
import os
import pickle
import random
import select
import time

import pytest
import torch
from _procs import SAFETY_S, fork, wait_status
from conftest import Mlp, export, reference_files
from executorch.exir import ExecutorchBackendConfig

import ptdstream
from ptdstream import ChunkedFileSink
from ptdstream.manager import plan_manager
from ptdstream.write.set_writer import write_save_plan

PTD = "_default_external_constant.ptd"
PTE = "model.pte"
TARGETS = (PTD, PTE)
ROUNDS = 12


@pytest.fixture(scope="module")
def managers():
    config = ExecutorchBackendConfig(external_constants=True)
    torch.manual_seed(0)
    a = export(Mlp(256, 512, 64), config=config, inputs=(torch.randn(2, 256),))
    torch.manual_seed(1)
    b = export(Mlp(512, 256, 32), config=config, inputs=(torch.randn(2, 512),))
    return {"A": a, "B": b}


@pytest.fixture(scope="module")
def versions(managers, tmp_path_factory):
    """``{version: {file name: bytes}}`` as upstream's serializer writes them."""
    out = {
        name: reference_files(m, str(tmp_path_factory.mktemp(f"reference_{name}")))
        for name, m in managers.items()
    }
    for target in TARGETS:
        assert out["A"][target] != out["B"][target], f"{target}: the versions must differ"
    return out


def version_of(path: str, versions) -> str:
    """Which save's file ``path`` holds: "A", "B", "missing" or "neither"."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return "missing"
    name = os.path.basename(path)
    return next((v for v, files in versions.items() if files[name] == data), "neither")


class JitteredPublish(ChunkedFileSink):
    """Both racers end writing together, then each rename waits 0-30 ms.

    After syncing its .pte (the last file; publishing comes next), each racer
    waits for the other at a barrier of marker files in ``barrier_dir`` (1 s at
    most): the two publish steps then overlap, which unsynchronised fsyncs of two
    real saves make rare. The waits before renames stand for slow folder fsyncs.
    """

    rng = random.Random()
    barrier_dir = ""

    def sync(self):
        super().sync()
        if self.target.endswith(".pte"):
            open(os.path.join(self.barrier_dir, str(os.getpid())), "w").close()
            deadline = time.monotonic() + 1.0
            while len(os.listdir(self.barrier_dir)) < 2 and time.monotonic() < deadline:
                time.sleep(0.0005)

    def publish(self):
        time.sleep(self.rng.uniform(0, 0.03))
        super().publish()


def jittered_save(manager, path: str, barrier_dir: str) -> None:
    JitteredPublish.rng = random.Random(os.getpid())
    JitteredPublish.barrier_dir = barrier_dir
    write_save_plan(plan_manager(manager, path), sink_factory=JitteredPublish)


def wait(pid: int, timeout_s: float = SAFETY_S) -> int:
    """The child's exit code; kills it and fails after ``timeout_s``."""
    return os.waitstatus_to_exitcode(wait_status(pid, timeout_s))


@pytest.fixture(scope="module")
def race_rounds(managers, versions, tmp_path_factory):
    """Run the rounds once; each round's ``(how, exit codes, {file: version}, leftovers)``."""
    folder = tmp_path_factory.mktemp("race")
    path = str(folder / PTE)
    rounds = []
    for i in range(ROUNDS):
        how = "save" if i % 2 == 0 else "jittered publish"
        barrier_dir = tmp_path_factory.mktemp(f"barrier{i}")
        r, w = os.pipe()

        def racer(name, w=w, r=r, how=how, barrier_dir=barrier_dir):  # this round's, bound now
            def run():
                os.close(w)
                os.read(r, 1)  # both start when the parent writes
                if how == "save":
                    ptdstream.save(managers[name], path)
                else:
                    jittered_save(managers[name], path, str(barrier_dir))
            return run

        pids = [fork(racer(name)) for name in ("A", "B")]
        os.close(r)
        os.write(w, b"go")
        os.close(w)
        codes = [wait(pid) for pid in pids]
        files = {t: version_of(str(folder / t), versions) for t in TARGETS}
        leftovers = sorted(set(os.listdir(folder)) - set(TARGETS))
        rounds.append((how, codes, files, leftovers))
    return rounds


def test_concurrent_saves_each_file_is_one_saves_complete_file(race_rounds, capsys):
    for i, (how, codes, files, leftovers) in enumerate(race_rounds):
        assert codes == [0, 0], f"round {i} ({how}): a save failed"
        assert leftovers == [], f"round {i} ({how}): files left: {leftovers}"
        for target, version in files.items():
            assert version in ("A", "B"), f"round {i} ({how}): {target} is {version}"
    with capsys.disabled():
        sets = collections.Counter(f"{f[PTE]}.pte+{f[PTD]}.ptd" for _, _, f, _ in race_rounds)
        print(f"\ntest_concurrency: {ROUNDS} rounds of two racing saves: {dict(sets)}")


def test_concurrent_saves_leave_one_saves_set(race_rounds):
    """The .pte and the .ptd are from the same save (the publish step is serialised)."""
    mixed = [
        (i, how, files) for i, (how, _, files, _) in enumerate(race_rounds)
        if files[PTE] != files[PTD]
    ]
    assert mixed == [], f"rounds whose .pte and .ptd come from different saves: {mixed}"


def read_until_stopped(folder: str, versions, stop_fd: int, result_fd: int, seen_fd: int) -> None:
    """Reader child: read every target again and again until ``stop_fd`` is readable;
    write to ``seen_fd`` the name of each save whose whole set it reads ("A", "B"),
    once each time it changes."""
    seen = {t: collections.Counter() for t in TARGETS}
    reads = 0
    last = None
    while not select.select([stop_fd], [], [], 0)[0]:
        now = {}
        for target in TARGETS:
            now[target] = version_of(os.path.join(folder, target), versions)
            seen[target][now[target]] += 1
            reads += 1
        if now[PTE] == now[PTD] != last and now[PTE] in ("A", "B"):
            last = now[PTE]
            os.write(seen_fd, last.encode())
    with os.fdopen(result_fd, "wb") as f:
        pickle.dump({"reads": reads, "seen": {t: dict(c) for t, c in seen.items()}}, f)


def test_reader_sees_only_complete_files_during_saves(managers, versions, tmp_path, capsys):
    folder = str(tmp_path)
    path = os.path.join(folder, PTE)
    ptdstream.save(managers["A"], path)
    stop_r, stop_w = os.pipe()
    result_r, result_w = os.pipe()
    seen_r, seen_w = os.pipe()

    def reader():
        os.close(stop_w)
        os.close(result_r)
        os.close(seen_r)
        read_until_stopped(folder, versions, stop_r, result_w, seen_w)

    def reader_saw(name: str) -> None:
        """Wait until the reader has read ``name``'s whole set (a fixed sleep let a
        reader that got no CPU see none of a save's files)."""
        deadline = time.monotonic() + 60
        got = b""
        while name.encode() not in got:
            ready, _, _ = select.select([seen_r], [], [], max(0.0, deadline - time.monotonic()))
            piece = os.read(seen_r, 64) if ready else b""
            assert piece, f"the reader did not read save {name}'s files within 60 s (it saw {got!r})"
            got += piece

    reader_pid = fork(reader)
    os.close(stop_r)
    os.close(result_w)
    os.close(seen_w)
    saves = ["B", "A"] * 5
    try:
        reader_saw("A")  # the reader is running
        for name in saves:
            assert wait(fork(lambda name=name: ptdstream.save(managers[name], path))) == 0
            reader_saw(name)
            time.sleep(0.01)
    finally:
        os.close(stop_w)
        os.close(seen_r)
        with os.fdopen(result_r, "rb") as f:
            data = f.read()
        code = wait(reader_pid)
    assert code == 0 and data, "the reader failed"
    result = pickle.loads(data)

    for target in TARGETS:
        seen = result["seen"][target]
        assert set(seen) <= {"A", "B"}, f"{target}: the reader saw {seen}"
        assert seen.get("A", 0) > 0 and seen.get("B", 0) > 0, (
            f"{target}: the reader never saw the file change ({seen})"
        )
    assert version_of(os.path.join(folder, PTE), versions) == saves[-1]
    assert sorted(os.listdir(folder)) == sorted(TARGETS)
    with capsys.disabled():
        print(
            f"\ntest_concurrency: a reader read {result['reads']} files during "
            f"{len(saves)} saves: {result['seen']}"
        )
