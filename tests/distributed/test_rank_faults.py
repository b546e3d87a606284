"""The distributed writer when its ranks disagree or fail (the README's claim 6): two
gloo ranks run the scenarios of ``_rank_faults_worker.py`` in one group. Keys that
differ across ranks are refused on every rank; a key order that differs is written in
rank 0's order; a piece changed after hand-over is refused on every rank naming the
rank, key, file and offset; an unwritten duplicate changed after the plan keeps the
handed-over bytes; rank 0 killed mid-write publishes nothing. And three ranks write
the one-process bytes, scalars and empty shards included."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from _procs import SAFETY_S
from conftest import read_folder as read_all
from conftest import write_two_file_set as _write_set

from ptdstream.save import write_data_files
from ptdstream.store import StreamingNamedDataStore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    worker = os.path.join(ROOT, "tests", "distributed", "_rank_faults_worker.py")
    proc = subprocess.run([sys.executable, worker, "2", str(root), *DIST_SCENARIOS], env=env, capture_output=True,
                          text=True, timeout=SAFETY_S + 300)  # the worker ends its ranks at SAFETY_S
    assert proc.returncode == 0, proc.stderr[-3000:]

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
