"""Set publication under a journal: a kill at EVERY publishing syscall leaves the
whole old set or (after recovery) the whole new one.

The kills come from ``ptdstream.system.fsops``'s hook (the in-process equivalent
of ``strace -f -e inject=rename:signal=SIGKILL:when=N``): a forked child saving
version B over version A kills itself with SIGKILL just before its N-th rename,
link, unlink or fsync, for every N of an uninterrupted save (and once past the
last). After each kill the folder is recovered (:func:`journal.recover`) and
must hold exactly A or exactly B, and nothing else.
"""

from __future__ import annotations

import collections
import errno
import json
import os

import pytest
import torch
from _journals import killed_set
from _procs import killed_at
from conftest import Mlp, export
from executorch.exir import ExecutorchBackendConfig

import ptdstream
from ptdstream.pack import pack, unpack
from ptdstream.system import fsops
from ptdstream.write import journal, tempfiles

PTE, PTD = "model.pte", "_default_external_constant.ptd"


@pytest.fixture(scope="module")
def versions():
    """Two managers whose .pte and .ptd both differ."""
    config = ExecutorchBackendConfig(external_constants=True)
    out = {}
    for seed, name in enumerate("AB"):
        torch.manual_seed(seed)
        out[name] = export(Mlp(d_hidden=32 + 16 * seed), config=config)
    return out


def read_all(folder) -> dict:
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


def recorded_ops(fn):
    """``[(op, path)]`` of the fsops calls ``fn()`` makes, in this process."""
    ops = []
    previous = fsops.set_hook(lambda op, path: ops.append((op, path)))
    try:
        fn()
    finally:
        fsops.set_hook(previous)
    return ops


def kill_everywhere(folder, write_old, write_new, old, new, capsys, label):
    """Kill ``write_new`` at each of its publishing calls over a folder holding ``old``."""
    write_old()
    assert read_all(folder) == old
    ops = recorded_ops(write_new)
    assert read_all(folder) == new
    kinds = collections.Counter(op for op, _ in ops)
    outcomes = collections.Counter()
    for n in range(1, len(ops) + 2):
        write_old()
        assert read_all(folder) == old
        killed = killed_at(n, write_new)
        assert killed == (n <= len(ops))
        pending = journal.unrecovered(folder)
        for p in pending:  # what verify reports: the journal and every file of its set
            assert set(p.targets) == {os.path.join(folder, t) for t in new}, p
        done = journal.recover(folder)
        assert [j for j, _ in done] == [p.path for p in pending]
        assert journal.unrecovered(folder) == []
        after = read_all(folder)
        op = ops[n - 1][0] if killed else "none"
        assert after in (old, new), (
            f"{label}: killed before call {n} ({ops[n - 1] if killed else 'none'}): "
            f"the folder holds {sorted(after)}, mixed or with leftovers"
        )
        outcomes[("old" if after == old else "new", op, "journal" if pending else "")] += 1
    with capsys.disabled():
        print(f"\n{label}: {len(ops) + 1} kills ({dict(kinds)}): " + ", ".join(
            f"{'/'.join(x for x in k if x)}: {v}" for k, v in sorted(outcomes.items())))
    return outcomes


@pytest.mark.parametrize("manifest", [False, True], ids=["pte+ptd", "pte+ptd+manifest"])
def test_kill_at_every_publishing_call_of_a_two_file_save(versions, tmp_path, capsys, manifest):
    folder = str(tmp_path)
    path = os.path.join(folder, PTE)
    sets = {}
    for name in "AB":
        ptdstream.save(versions[name], path, manifest=manifest)
        sets[name] = read_all(folder)
    assert sorted(sets["A"]) == [PTD] + (["model.manifest"] if manifest else []) + [PTE]
    assert all(sets["A"][n] != sets["B"][n] for n in sets["A"])
    outcomes = kill_everywhere(
        folder,
        lambda: ptdstream.save(versions["A"], path, manifest=manifest),
        lambda: ptdstream.save(versions["B"], path, manifest=manifest),
        sets["A"], sets["B"], capsys, f"save ({'+'.join(sorted(sets['A']))})",
    )
    # The journal was exercised both ways: kills between the renames rolled forward.
    assert any(k[0] == "new" and k[2] == "journal" for k in outcomes), outcomes
    assert any(k[0] == "old" for k in outcomes), outcomes


def test_kill_at_every_publishing_call_of_a_first_save(versions, tmp_path, capsys):
    """No previous set: after a kill the folder is empty or holds the whole new set."""
    folder = str(tmp_path)
    path = os.path.join(folder, PTE)
    ptdstream.save(versions["B"], path)
    new = read_all(folder)

    def clear():
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))

    kill_everywhere(folder, clear, lambda: ptdstream.save(versions["B"], path), {}, new, capsys, "first save")


def test_kill_at_every_publishing_call_of_unpack(tmp_path, capsys):
    src = tmp_path / "src"
    out = tmp_path / "out"
    src.mkdir()
    out.mkdir()
    for name, fill in (("a", 1), ("b", 2)):
        (src / name).write_bytes(bytes([fill]) * 100_000 + os.urandom(1000))
        pack(str(src / name), str(src / f"{name}.zst"))
    target = str(out / "x.bin")
    kill_everywhere(
        str(out),
        lambda: unpack(str(src / "a.zst"), target),
        lambda: unpack(str(src / "b.zst"), target),
        {"x.bin": (src / "a").read_bytes()}, {"x.bin": (src / "b").read_bytes()}, capsys, "unpack",
    )


def _half_published(folder):
    """A folder as a crash leaves it after the first of two renames: a.ptd new,
    b.pte old, the journal and the backups on disk; returns (journal, temps)."""
    [path], entries = killed_set([os.path.join(folder, "a.ptd"), os.path.join(folder, "b.pte")])
    return path, [e.temp for e in entries]


def test_recovery_rolls_forward_a_half_published_set(tmp_path):
    folder = str(tmp_path)
    path, _ = _half_published(folder)
    assert journal.unrecovered(folder) == [
        journal.PendingSet(path, (str(tmp_path / "a.ptd"), str(tmp_path / "b.pte")))
    ]
    assert journal.recover(folder) == [(path, "forward")]
    assert read_all(folder) == {"a.ptd": b"new a.ptd", "b.pte": b"new b.pte"}


def test_recovery_rolls_back_when_a_temp_file_is_lost(tmp_path):
    """A temp file removed by someone else: the set cannot go forward, so the
    backups are put back and the old set is whole."""
    folder = str(tmp_path)
    path, temps = _half_published(folder)
    os.unlink(temps[1])
    assert journal.recover(folder) == [(path, "back")]
    assert read_all(folder) == {"a.ptd": b"old a.ptd", "b.pte": b"old b.pte"}


@pytest.mark.parametrize("way", ["forward", "back"])
def test_an_os_error_midway_names_the_journal_which_finishes_later(tmp_path, way):
    """Forward: b.pte renamed, then its folder's fsync fails; back (b.pte's temp
    lost): b.pte's backup put back, then a.ptd's rename fails. Either way the
    journal stays and a second recovery completes the set."""
    folder = str(tmp_path)
    path, temps = _half_published(folder)
    if way == "back":
        os.unlink(temps[1])
    failing = ("fsync_dir", folder) if way == "forward" else ("rename", str(tmp_path / "a.ptd"))
    ops = []

    def hook(op, p):
        ops.append((op, p))
        if (op, p) == failing:
            raise OSError(errno.EIO, "Input/output error")

    previous = fsops.set_hook(hook)
    try:
        with pytest.raises(journal.RecoveryError) as info:
            journal.recover(folder)
    finally:
        fsops.set_hook(previous)
    assert str(info.value) == (
        f"journal {path}: recovery stopped by OSError: [Errno 5] Input/output error; the journal stays with the "
        f"files it names, completed up to there; fix the cause, then run recover on {folder} again")
    assert ops[0] == ("rename", str(tmp_path / "b.pte")) and ops[-1] == failing  # midway: b.pte done
    assert os.path.exists(path)
    assert journal.recover(folder) == [(path, way)]
    assert read_all(folder) == ({"a.ptd": b"new a.ptd", "b.pte": b"new b.pte"} if way == "forward"
                                else {"a.ptd": b"old a.ptd", "b.pte": b"old b.pte"})


def test_the_next_save_recovers_the_folder_first(versions, tmp_path):
    folder = str(tmp_path)
    path, _ = _half_published(folder)
    ptdstream.save(versions["A"], os.path.join(folder, PTE))
    assert sorted(os.listdir(folder)) == [PTD, "a.ptd", "b.pte", PTE]
    assert read_all(folder)["b.pte"] == b"new b.pte"


def test_an_unreadable_journal_is_reported_and_kept(tmp_path):
    bad = tmp_path / ".b.pte.ptdstream-1-0000abcd.journal"
    bad.write_bytes(b"{not json")
    assert journal.unrecovered(str(tmp_path)) == [journal.PendingSet(str(bad), ())]
    with pytest.raises(journal.RecoveryError, match=r"journal .*0000abcd.journal: unreadable"):
        journal.recover(str(tmp_path))
    assert bad.exists()


def test_a_live_writers_temp_file_is_kept_whatever_its_pid(tmp_path):
    """Liveness by lock: a temp file named after a pid that does not exist here
    (another PID namespace) but locked is kept; unlocked, it is removed."""
    target = str(tmp_path / "m.pte")
    temp, fd, lock_fd = tempfiles.create_locked(target)
    os.close(fd)
    foreign = temp.replace(f"ptdstream-{os.getpid()}-", "ptdstream-999999999-")
    os.rename(temp, foreign)
    journal.clean_folder(str(tmp_path))
    assert os.path.exists(foreign)
    os.close(lock_fd)
    journal.clean_folder(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_moved_folder_recovers_itself(tmp_path):
    """The journal's paths are relative to its folder: after ``mv``, recovery rolls
    the moved folder forward (its inodes are the journal's) and loses nothing."""
    folder = tmp_path / "set"
    folder.mkdir()
    _half_published(str(folder))
    moved = tmp_path / "moved"
    os.rename(folder, moved)
    [(path, direction)] = journal.recover(str(moved))
    assert direction == "forward" and os.path.dirname(path) == str(moved)
    assert read_all(str(moved)) == {"a.ptd": b"new a.ptd", "b.pte": b"new b.pte"}
    assert not folder.exists()


def test_recovering_a_copy_is_refused_and_leaves_both_alone(tmp_path):
    """A copied folder (new inodes, another folder's device and inode): its journal
    proves nothing there, so the copy is refused untouched, naming the folder field;
    the original's journal still completes it forward."""
    import shutil

    original = tmp_path / "original"
    original.mkdir()
    path, _ = _half_published(str(original))
    before = read_all(str(original))
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    copied = read_all(str(copy))
    fst, cst = os.stat(original), os.stat(copy)
    with pytest.raises(journal.RecoveryError) as info:
        journal.recover(str(copy))
    assert str(info.value).startswith(
        f"journal {copy / os.path.basename(path)}: folder {[fst.st_dev, fst.st_ino]} is not the device and inode "
        f"of the folder it lies in {[cst.st_dev, cst.st_ino]} (a journal copied from another folder, or planted); "
        f"refused: the journal and every file are left in place, none touched")
    assert read_all(str(copy)) == copied
    assert read_all(str(original)) == before
    [(_, direction)] = journal.recover(str(original))
    assert direction == "forward"
    assert read_all(str(original)) == {"a.ptd": b"new a.ptd", "b.pte": b"new b.pte"}


def test_a_set_in_two_folders_has_one_journal_per_folder_naming_only_its_files(tmp_path):
    """A journal names only files of its own folder: a set across folders (``data_dir=``)
    is journaled folder by folder; a failed rename still puts both folders back."""
    import errno
    import functools

    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    out.mkdir()
    (data / "w.ptd").write_bytes(b"old w")
    (out / "m.pte").write_bytes(b"old m")
    temps = []
    for folder, name in ((data, "w.ptd"), (out, "m.pte")):
        temp, fd, lock_fd = tempfiles.create_locked(str(folder / name))
        os.write(fd, b"new " + name.encode())
        os.close(fd)
        os.close(lock_fd)
        temps.append(temp)
    seen = {}

    def second_rename_fails():
        for folder in (data, out):
            [path] = [p for p, _, s in tempfiles.temp_files_in(str(folder)) if s == "journal"]
            seen[folder.name] = [os.path.relpath(e.target, tmp_path) for e in journal.read_journal(path)]
        raise OSError(errno.EIO, "injected EIO on the rename of m.pte")

    with pytest.raises(OSError, match="injected EIO on the rename of m.pte"):
        journal.publish([(temps[0], str(data / "w.ptd")), (temps[1], str(out / "m.pte"))],
                        renames=[functools.partial(journal._rename, temps[0], str(data / "w.ptd")),
                                 second_rename_fails])
    assert seen == {"data": ["data/w.ptd"], "out": ["out/m.pte"]}
    assert read_all(str(data)) == {"w.ptd": b"old w"} and read_all(str(out)) == {"m.pte": b"old m"}


def test_kill_at_every_publishing_call_of_a_save_with_a_data_dir(versions, tmp_path, capsys):
    """Either folder recovered first (a writer into the data folder, or
    ``recover`` of either): both folders hold the old set or both the new one. The
    set's main journal, beside the .pte, is written last: its commit point."""
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    out.mkdir()
    path = str(out / PTE)
    sets = {}
    for name in "AB":
        ptdstream.save(versions[name], path, data_dir=str(data))
        sets[name] = (read_all(str(data)), read_all(str(out)))
    ops = recorded_ops(lambda: ptdstream.save(versions["B"], path, data_dir=str(data)))
    journal_renames = [i + 1 for i, (op, p) in enumerate(ops) if op == "rename" and p.endswith(".journal")]
    assert len(journal_renames) == 2, ops
    window = range(journal_renames[0] + 1, journal_renames[1] + 1)  # the member journal renamed, not the main
    mixed = []
    for n in range(1, len(ops) + 2):
        ptdstream.save(versions["A"], path, data_dir=str(data))
        killed_at(n, lambda: ptdstream.save(versions["B"], path, data_dir=str(data)))
        first, second = (data, out) if n % 2 else (out, data)
        journal.recover(str(first))
        journal.recover(str(second))
        assert journal.unrecovered(str(data)) == journal.unrecovered(str(out)) == []
        parts = (read_all(str(data)), read_all(str(out)))
        assert parts[0] in (sets["A"][0], sets["B"][0]) and parts[1] in (sets["A"][1], sets["B"][1]), n
        if parts not in (sets["A"], sets["B"]):
            mixed.append(n)
    assert mixed == [], (mixed, list(window), ops)
    with capsys.disabled():
        print(f"\nsave with data_dir: {len(ops) + 1} kills, none left the folders mixed "
              f"({len(window)} between the two journals)")


def _half_published_across(tmp_path):
    """A set in data/ (w.ptd) and out/ (m.pte), killed after the first rename:
    a member journal in data/, the main journal in out/."""
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    out.mkdir()
    journals, _ = killed_set([data / "w.ptd", out / "m.pte"])
    return data, out, journals


def test_a_copy_of_one_folder_of_a_set_across_folders_is_refused(tmp_path):
    """The copy's main journal would reach the original data folder: refused, and
    the original set still recovers forward."""
    import shutil

    data, out, journals = _half_published_across(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    before = {str(f): read_all(str(f)) for f in (data, out, copy)}
    with pytest.raises(journal.RecoveryError, match=r"journal .*copy/.*: folder \[\d+, \d+\] is not the device and "
                                                    r"inode of the folder it lies in .* refused"):
        journal.recover(str(copy))
    assert {str(f): read_all(str(f)) for f in (data, out, copy)} == before
    assert journal.recover(str(data)) == [(journals[0], "forward")]
    assert journal.recover(str(out)) == [(journals[1], "forward")]
    assert read_all(str(data)) == {"w.ptd": b"new w.ptd"} and read_all(str(out)) == {"m.pte": b"new m.pte"}


def test_a_member_journal_its_main_journal_does_not_name_is_refused(tmp_path):
    data, out, journals = _half_published_across(tmp_path)
    doc = json.loads(open(journals[1]).read())
    doc["members"] = []  # the main journal no longer names the member
    with open(journals[1], "w") as f:
        json.dump(doc, f)
    before = {str(f): read_all(str(f)) for f in (data, out)}
    with pytest.raises(journal.RecoveryError, match=rf"journal {journals[0]}: its main journal {journals[1]} does "
                                                    r"not name it back; refused"):
        journal.recover(str(data))
    assert {str(f): read_all(str(f)) for f in (data, out)} == before
