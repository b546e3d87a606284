"""Adversarial probes of claims 6 (the distributed writer) and 7 (kills at every
publishing call, outputs that are inputs, files changed mid-save) that hold now.

Each asserts the exact outcome. The probes that found bugs are under
``tools/repro2/`` (not run by pytest).
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from _procs import fork, wait_status

from ptdstream.errors import IntegrityError
from ptdstream.save import write_data_files
from ptdstream.sources import file as file_sources
from ptdstream.sources.file import FileRangeSource
from ptdstream.store import StreamingNamedDataStore
from ptdstream.system import fsops
from ptdstream.write import journal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_all(folder) -> dict[str, bytes]:
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


# --- claim 7: a file-backed source changed while the save reads it ---------------------------------------------


def _rewrite(src):
    with open(src, "r+b") as f:  # in place, one byte past the first 32 of key b
        f.seek(9000)
        f.write(b"X")


def _truncate(src):
    os.truncate(src, 9000)


def _replace(src):
    with open(src + ".new", "wb") as f:
        f.write(b"Y" * 16384)
    os.replace(src + ".new", src)


@pytest.mark.parametrize("change, message", [
    (_rewrite, "changed while it was read"),
    (_truncate, "ended at offset 9000, expected 8192 bytes from offset 8192"),
    (_replace, "replaced before it was read"),
], ids=["rewritten-in-place", "truncated", "replaced"])
def test_a_file_source_changed_between_two_of_its_ranges_is_refused(tmp_path, monkeypatch, change, message):
    """Two keys read from two ranges of one file; the file changes after the first
    is written: IntegrityError naming the file and key b, the old target kept, no temp."""
    src = str(tmp_path / "blob.bin")
    with open(src, "wb") as f:
        f.write(os.urandom(16384))
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.ptd").write_bytes(b"previous")
    store = StreamingNamedDataStore()
    store.add_named_data("a", FileRangeSource(src, 0, 8192), alignment=16, external_tag="model")
    store.add_named_data("b", FileRangeSource(src, 8192, 8192), alignment=16, external_tag="model")
    original, calls = file_sources.FileRangeSource.pieces, [0]

    def pieces(self, ring):
        calls[0] += 1
        if calls[0] == 2:
            change(src)
        yield from original(self, ring)

    monkeypatch.setattr(file_sources.FileRangeSource, "pieces", pieces)
    with pytest.raises(IntegrityError) as e:
        write_data_files(store, str(out))
    assert "named data (key 'b') of model.ptd" in str(e.value) and f"file {src}: " in str(e.value)
    assert message in str(e.value) and str(e.value).endswith("nothing was published")
    assert read_all(out) == {"model.ptd": b"previous"}


def test_a_save_whose_file_source_is_its_own_output_writes_the_bytes_read(tmp_path):
    """The library replaces (as upstream does): a key read from out/model.ptd while
    out/model.ptd is written gets the old file's bytes, the new file is whole."""
    out = tmp_path / "out"
    out.mkdir()
    old = os.urandom(4096)
    (out / "model.ptd").write_bytes(old)
    store = StreamingNamedDataStore()
    store.add_named_data("a", FileRangeSource(str(out / "model.ptd"), 100, 1000), alignment=16, external_tag="model")
    store.add_named_data("b", torch.arange(10.0), alignment=16, external_tag="model")
    write_data_files(store, str(out))
    ref_store = StreamingNamedDataStore()
    ref_store.add_named_data("a", old[100:1100], alignment=16, external_tag="model")
    ref_store.add_named_data("b", torch.arange(10.0), alignment=16, external_tag="model")
    (tmp_path / "ref").mkdir()
    write_data_files(ref_store, str(tmp_path / "ref"))
    assert read_all(out) == read_all(tmp_path / "ref")


# --- claim 7: kills at every publishing call, and at every call of the recovery after it ---------------------


def _write_set(folder, version: int) -> None:
    """A two-file set (a.ptd, b.ptd) whose files both differ between versions."""
    store = StreamingNamedDataStore()
    g = torch.Generator().manual_seed(version)
    for tag in ("a", "b"):
        store.add_named_data(f"{tag}.w", torch.randn(64 + version, generator=g), alignment=16, external_tag=tag)
    write_data_files(store, str(folder))


def _killed_at(n: int, fn) -> bool:
    def child():
        count = [0]

        def hook(op, path):
            count[0] += 1
            if count[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)

        fsops.set_hook(hook)
        fn()

    status = wait_status(fork(child), 60.0)
    if os.WIFSIGNALED(status):
        return True
    assert os.waitstatus_to_exitcode(status) == 0
    return False


def test_a_recovery_killed_at_each_of_its_calls_still_ends_old_or_new(tmp_path):
    """The save killed before each of its publishing calls; where that leaves a
    journal, the recovery itself killed before each of its calls, then recovered
    again: the folder holds exactly the old set or exactly the new one."""
    folder = tmp_path / "f"

    def fresh_old():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        _write_set(folder, 0)

    fresh_old()
    old = read_all(folder)
    ops = []
    previous = fsops.set_hook(lambda op, path: ops.append(op))
    try:
        _write_set(folder, 1)
    finally:
        fsops.set_hook(previous)
    new = read_all(folder)
    assert sorted(old) == sorted(new) == ["a.ptd", "b.ptd"] and old["a.ptd"] != new["a.ptd"]
    outcomes = collections.Counter()
    with_journal = []
    for n in range(1, len(ops) + 1):
        fresh_old()
        assert _killed_at(n, lambda: _write_set(folder, 1))
        if journal.unrecovered(str(folder)):
            with_journal.append(n)
        journal.recover(str(folder))
        assert read_all(folder) in (old, new), (n, sorted(os.listdir(folder)))
    assert with_journal, "no kill point left a journal"
    for n in (with_journal[0], with_journal[len(with_journal) // 2], with_journal[-1]):
        for m in range(1, 40):
            fresh_old()
            assert _killed_at(n, lambda: _write_set(folder, 1))
            killed = _killed_at(m, lambda: journal.recover(str(folder)))
            journal.recover(str(folder))
            assert journal.unrecovered(str(folder)) == []
            after = read_all(folder)
            assert after in (old, new), (n, m, sorted(after))
            outcomes["old" if after == old else "new"] += 1
            if not killed:
                break
        else:
            pytest.fail("a recovery of more than 40 calls")
    assert sum(outcomes.values()) >= 6


# --- claim 6: the distributed writer, 2 gloo ranks -----------------------------------------------------------

DIST_SCENARIOS = ["lie-key-missing", "lie-plain-and-dtensor", "lie-key-order", "change-shard-written",
                  "change-shard-dedup-written", "change-shard-dedup-unwritten", "change-replicate-owner",
                  "change-between-describe-and-plan", "freed-storage", "kill-rank0-in-write"]


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    for name in DIST_SCENARIOS:
        (root / name).mkdir()
        if name != "lie-key-order" and name != "change-shard-dedup-unwritten":
            (root / name / "model.ptd").write_bytes(b"previous")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_breaker2_dist.py"), "2", str(root),
                    *DIST_SCENARIOS], env=env, capture_output=True, timeout=300)

    def outcome(name):
        out = []
        for r in (0, 1):
            p = root / f"{name}.rank{r}"
            out.append(p.read_text() if p.exists() else None)
        return out

    return root, outcome


def _full():
    return torch.randn(6, 3, generator=torch.Generator().manual_seed(1))


def _one_process(tensors, folder):
    store = StreamingNamedDataStore()
    for key, t in tensors.items():
        store.add_named_data(key, t, alignment=1, external_tag="model")
    folder.mkdir()
    write_data_files(store, str(folder))
    return (folder / "model.ptd").read_bytes()


@pytest.mark.parametrize("name, error", [
    ("lie-key-missing", "DistributedWriteError: fingerprint the dedup candidates: ranks 0, 1: LayoutError: key 'x': "
                        "the pieces hold 36 bytes, the tensor 72; nothing was published"),
    ("lie-plain-and-dtensor", "DistributedWriteError: fingerprint the dedup candidates: ranks 0, 1: LayoutError: key "
                              "'w' is held by ranks [0, 1]; a key that is not a DTensor must be on one rank; nothing "
                              "was published"),
])
def test_keys_that_differ_across_ranks_are_refused_on_every_rank(dist_run, name, error):
    root, outcome = dist_run
    assert outcome(name) == [f"error ptdstream.distributed.errors.{error}"] * 2
    assert read_all(root / name) == {"model.ptd": b"previous"}


def test_a_key_order_that_differs_across_ranks_writes_rank_0s_order(dist_run, tmp_path):
    root, outcome = dist_run
    assert outcome("lie-key-order") == ["ok ['model.ptd']"] * 2
    full = _full()
    assert (root / "lie-key-order" / "model.ptd").read_bytes() == _one_process({"a": full, "b": full * 2},
                                                                               tmp_path / "ref")


@pytest.mark.parametrize("name, key, fragment", [
    ("change-shard-written", "a", "changed after it was handed over (its first bytes differ from the plan's)"),
    ("change-shard-dedup-written", "a", "changed after it was handed over (its first bytes differ from the plan's)"),
    ("change-replicate-owner", "r", "changed after it was handed over (digest "),
    ("change-between-describe-and-plan", "m", "changed after it was handed over (digest "),
    ("freed-storage", "p1", "its storage holds 0 bytes, 72 needed; was it freed or resized after it was added?"),
], ids=["shard", "shard-written-key-of-dedup-class", "replicate-owner", "before-plan", "storage-freed"])
def test_a_piece_changed_after_hand_over_is_refused_on_every_rank(dist_run, name, key, fragment):
    """A Shard(0) piece of rank 1 (alone or the written key of a dedup class), the
    owner's copy of a Replicate tensor, a plain tensor changed before the plan, a
    storage freed: DistributedIntegrityError on both ranks naming rank 1, the key,
    file and offset; the previous file kept, no temp left."""
    root, outcome = dist_run
    out = outcome(name)
    assert out[0] == out[1], out
    text = out[0]
    assert text.startswith("error ptdstream.distributed.errors.DistributedIntegrityError: write the pieces: "
                           f"rank 1: IntegrityError: {root / name / 'model.ptd'} at offset "), text
    assert f"rank 1 key {key!r}" in text and fragment in text and text.endswith("; nothing was published"), text
    assert read_all(root / name) == {"model.ptd": b"previous"}


def test_an_unwritten_duplicate_changed_after_the_plan_keeps_the_handed_over_bytes(dist_run, tmp_path):
    root, outcome = dist_run
    assert outcome("change-shard-dedup-unwritten") == ["ok ['model.ptd']"] * 2
    full = _full()
    assert (root / "change-shard-dedup-unwritten" / "model.ptd").read_bytes() == _one_process(
        {"a": full, "b": full.clone()}, tmp_path / "ref")


def test_rank_0_killed_mid_write_publishes_nothing_and_the_next_save_removes_its_temp(dist_run, tmp_path):
    root, outcome = dist_run
    folder = root / "kill-rank0-in-write"
    out = outcome("kill-rank0-in-write")
    assert out[0] is None
    assert out[1].startswith("error ptdstream.distributed.errors.DistributedWriteError: write the pieces: the "
                             "group failed (a rank was killed, timed out or left): RuntimeError: "), out
    assert out[1].endswith("; nothing was published")
    names = sorted(os.listdir(folder))
    assert names[-1] == "model.ptd" and (folder / "model.ptd").read_bytes() == b"previous"
    assert all(n.startswith(".model.ptd.ptdstream-") and n.endswith(".tmp") for n in names[:-1]), names
    _write_set(folder, 0)  # the next save into the folder
    assert sorted(os.listdir(folder)) == ["a.ptd", "b.ptd", "model.ptd"]


@pytest.mark.slow
def test_three_ranks_write_the_one_process_bytes_scalars_and_empty_shards_included(tmp_path):
    """World 3 (odd: Shard(0) of 3 rows is 1+1+1, of 1 row 1+0+0, the replicate owners
    spread differently), the shipped worker's "ok" and "edges" scenarios."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))
    import _dist_worker as W
    import test_writer as T

    root, out = T._run(3, tmp_path, ["ok", "edges"])
    (tmp_path / "ok-ref").mkdir()
    T._check_ok(root / "ok", out["ok"], tmp_path / "ok-ref", 3)
    assert all(o is not None and o.startswith("ok") for o in out["edges"].values()), out["edges"]
    tensors = {k: t for k, (t, _) in W.edge_tensors(3).items()}
    for r in range(3):
        tensors.update(W.edge_rank_tensors(r))
    T._reference(tensors, tmp_path / "ref")
    T._same_files(root / "edges", tmp_path / "ref", ["model.ptd"])
