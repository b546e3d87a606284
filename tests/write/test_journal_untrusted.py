"""A journal is untrusted input: it names only files of its own folder, of the
shape ptdstream writes; a damaged, planted or outdated one touches no file and
leaves the folder usable for unrelated saves."""

from __future__ import annotations

import json
import os
import time

import pytest
from _journals import killed_set

from ptdstream import ChunkedFileSink, StreamingNamedDataStore
from ptdstream.save import write_data_files
from ptdstream.write import journal, tempfiles

JNAME = ".b.pte.ptdstream-1-0000abcd.journal"


def snapshot(root) -> dict:
    """Every path under ``root`` (links as links) with its bytes or link text."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                out[path] = ("link", os.readlink(path))
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    out[path] = f.read()
    return out


def temp_file(folder, target_name, data: bytes) -> str:
    """An unlocked temp file of ``target_name`` in ``folder`` (its writer is gone)."""
    temp, fd, lock_fd = tempfiles.create_locked(os.path.join(folder, target_name))
    os.write(fd, data)
    os.close(fd)
    os.close(lock_fd)
    return temp


def plant(folder, rows, name=JNAME) -> str:
    """A journal of this ptdstream's version and shape, recording ``folder`` as its own."""
    path = os.path.join(folder, name)
    st = os.stat(folder)
    with open(path, "w") as f:
        json.dump({"ptdstream_journal": journal.JOURNAL_VERSION, "folder": [st.st_dev, st.st_ino], "main": None,
                   "members": [], "entries": rows}, f)
    return path


def state(dev, ino, size=0):
    return {"dev": dev, "ino": ino, "size": size, "ctime_ns": 0, "mtime_ns": 0}


def row(target, temp, *, backup=None, had_target=True, ident=None):
    st = os.lstat(temp) if ident is None and os.path.lexists(temp) else None
    dev, ino = ident if ident is not None else ((st.st_dev, st.st_ino) if st else (0, 0))
    return {"target": target, "temp": os.path.basename(temp) if os.path.isabs(temp) else temp,
            "backup": backup, "had_target": had_target, "dev": dev, "ino": ino, "mark": None,
            "new": state(dev, ino), "old": state(1, 1) if had_target else None}


@pytest.fixture
def outside(tmp_path):
    """``tmp_path/dir`` (the journal's folder) and a precious file beside it."""
    (tmp_path / "outside").mkdir()
    victim = tmp_path / "outside" / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "dir").mkdir()
    return str(tmp_path / "dir"), str(victim)


def escaping_rows(folder, victim, shape):
    temp = temp_file(folder, "b.pte", b"evil")
    if shape == "dotdot":
        return [row(os.path.relpath(victim, folder), temp)], "../outside/victim"
    if shape == "absolute":
        return [row(victim, temp)], victim
    if shape == "subfolder":
        os.mkdir(os.path.join(folder, "sub"))
        with open(os.path.join(folder, "sub", "victim"), "wb") as f:
            f.write(b"precious too")
        return [row("sub/victim", temp)], "sub/victim"
    if shape == "symlinked folder":
        os.symlink(os.path.dirname(victim), os.path.join(folder, "link"))
        return [row("link/victim", temp)], "link/victim"
    raise AssertionError(shape)


@pytest.mark.parametrize("shape", ["dotdot", "absolute", "subfolder", "symlinked folder"])
def test_a_journal_naming_a_file_outside_its_folder_is_refused_and_touches_nothing(outside, shape):
    folder, victim = outside
    rows, shown = escaping_rows(folder, victim, shape)
    path = plant(folder, rows)
    before = snapshot(os.path.dirname(folder))
    with pytest.raises(journal.RecoveryError) as info:
        journal.recover(folder)
    assert f"journal {path}: entry 0: target {shown!r} is not a plain file name" in str(info.value)
    assert "none touched" in str(info.value)
    assert snapshot(os.path.dirname(folder)) == before
    # The next writer into the folder leaves it alone too (and writes its file).
    with ChunkedFileSink(os.path.join(folder, "other.bin")) as sink:
        sink.write(b"unrelated")
    after = snapshot(os.path.dirname(folder))
    assert after.pop(os.path.join(folder, "other.bin")) == b"unrelated"
    assert after == before


@pytest.mark.parametrize("version", [1, 2, 3])
def test_a_journal_of_an_older_version_is_refused_by_name(tmp_path, version):
    """Versions 1 to 3 record no mark of their files (1 and 2 no states): they
    cannot prove a file is their save's, so they act on none."""
    folder = str(tmp_path)
    path, _, _ = half_published(folder)
    with open(path) as f:
        doc = json.load(f)
    doc["ptdstream_journal"] = version
    for r in doc["entries"]:
        del r["mark"]
    with open(path, "w") as f:
        json.dump(doc, f)
    before = snapshot(tmp_path)
    with pytest.raises(journal.RecoveryError) as info:
        journal.recover(folder)
    assert str(info.value).startswith(
        f"journal {path}: version {version}, written by an older ptdstream: it records no mark of its files, so it "
        f"cannot prove them (recover it with the ptdstream that wrote it, or check the files by hand); refused: "
        f"the journal and every file are left in place, none touched")
    assert snapshot(tmp_path) == before


def test_a_temp_name_not_derived_from_its_target_is_refused(tmp_path):
    """Else a user's file named as the temp file would be renamed over the target."""
    (tmp_path / "b.pte").write_bytes(b"mine")
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"the user's notes")
    plant(str(tmp_path), [row("b.pte", str(notes))])
    before = snapshot(tmp_path)
    with pytest.raises(journal.RecoveryError, match=r"entry 0: temp 'notes.txt' is not a temp name of target "
                                                    r"'b.pte' \(\.b\.pte\.ptdstream-<pid>-<hex>\.tmp\)"):
        journal.recover(str(tmp_path))
    assert snapshot(tmp_path) == before


def test_a_backup_name_not_derived_from_its_target_is_refused(tmp_path):
    """Else a roll back would move a user's file over the target."""
    (tmp_path / "b.pte").write_bytes(b"mine")
    (tmp_path / "keep.txt").write_bytes(b"keep me")
    plant(str(tmp_path), [row("b.pte", ".b.pte.ptdstream-1-00000001.tmp", backup="keep.txt", ident=(1, 1))])
    before = snapshot(tmp_path)
    with pytest.raises(journal.RecoveryError, match=r"entry 0: backup 'keep.txt' is not a backup name of target"):
        journal.recover(str(tmp_path))
    assert snapshot(tmp_path) == before


def test_a_target_named_twice_is_refused(tmp_path):
    """Else the second entry's roll back deletes the file the first one names."""
    a = tmp_path / "b.pte"
    a.write_bytes(b"the user's file")
    st = os.lstat(a)
    rows = [row("b.pte", ".b.pte.ptdstream-1-00000001.tmp", ident=(1, 1)),
            row("b.pte", ".b.pte.ptdstream-1-00000002.tmp", had_target=False, ident=(st.st_dev, st.st_ino))]
    plant(str(tmp_path), rows)
    before = snapshot(tmp_path)
    with pytest.raises(journal.RecoveryError, match=r"entry 1: names 'b.pte' again \(entry 0 names it too\)"):
        journal.recover(str(tmp_path))
    assert snapshot(tmp_path) == before


def test_a_nul_byte_in_a_name_is_refused_as_a_recovery_error(tmp_path):
    plant(str(tmp_path), [row("b\0.pte", ".b.pte.ptdstream-1-00000001.tmp", ident=(1, 1))])
    before = snapshot(tmp_path)
    with pytest.raises(journal.RecoveryError, match=r"entry 0: target 'b\\x00.pte' is not a plain file name"):
        journal.recover(str(tmp_path))
    assert snapshot(tmp_path) == before


def test_a_journal_naming_itself_is_refused(tmp_path):
    path = plant(str(tmp_path), [row(JNAME, ".b.pte.ptdstream-1-00000001.tmp", had_target=False, ident=(0, 0))])
    st = os.lstat(path)  # rewritten in place: the entry names the journal's own inode
    plant(str(tmp_path), [row(JNAME, ".b.pte.ptdstream-1-00000001.tmp", had_target=False,
                              ident=(st.st_dev, st.st_ino))])
    before = snapshot(tmp_path)
    with pytest.raises(journal.RecoveryError, match=rf"entry 0: target '{JNAME}' is a ptdstream temp or journal "
                                                    r"name"):
        journal.recover(str(tmp_path))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink out"])
def test_a_target_that_is_not_a_regular_file_is_refused_before_any_file_is_touched(outside, kind):
    """Entry 1 names ``sub``, recorded as it is on disk: rolling forward would
    first replace a.ptd, then fail on the directory (or replace the fifo/link)."""
    folder, victim = outside
    a, sub = os.path.join(folder, "a.ptd"), os.path.join(folder, "sub")
    with open(a, "wb") as f:
        f.write(b"old a")
    if kind == "directory":
        os.mkdir(sub)
        with open(os.path.join(sub, "inner"), "wb") as f:
            f.write(b"x")
    elif kind == "fifo":
        os.mkfifo(sub)
    else:
        os.symlink(victim, sub)
    entries = []
    for target in (a, sub):
        temp = temp_file(folder, os.path.basename(target), b"new " + os.path.basename(target).encode())
        st = os.lstat(temp)
        entries.append(journal.JournalEntry(target, temp, None, True, st.st_dev, st.st_ino))
    path = journal._write_journal(sub, entries)
    before = snapshot(os.path.dirname(folder))
    modes = {n: os.lstat(os.path.join(folder, n)).st_mode for n in os.listdir(folder)}
    what = {"directory": "a directory", "fifo": "a fifo", "symlink out": f"a symbolic link to {victim!r}"}[kind]
    with pytest.raises(journal.RecoveryError) as info:
        journal.recover(folder)
    assert str(info.value).startswith(
        f"journal {path}: entry 1: target 'sub' is {what}, not a regular file (a journal's targets are files "
        f"ptdstream writes); refused: the journal and every file are left as they are, none touched")
    assert snapshot(os.path.dirname(folder)) == before
    assert {n: os.lstat(os.path.join(folder, n)).st_mode for n in os.listdir(folder)} == modes


# --- files changed by another program after a killed save ---------------------------------------


def half_published(folder, names=("a.ptd", "b.pte")):
    """A kill after the first of two renames: the first target new, the second old,
    the backups and the journal on disk; returns (journal, temps, backups)."""
    [path], entries = killed_set([os.path.join(folder, n) for n in names])
    return path, [e.temp for e in entries], [e.backup for e in entries]


def test_a_target_replaced_by_another_program_is_refused_by_name(tmp_path):
    """``mv new b.pte`` after the kill: rolling forward would put the killed save's
    b.pte over the newer one."""
    folder = str(tmp_path)
    path, _, _ = half_published(folder)
    (tmp_path / "elsewhere").write_bytes(b"a newer b.pte")
    os.replace(tmp_path / "elsewhere", tmp_path / "b.pte")
    ino = os.lstat(tmp_path / "b.pte").st_ino
    before = snapshot(tmp_path)
    with pytest.raises(journal.RecoveryError) as info:
        journal.recover(folder)
    assert f"journal {path}: another program changed the set's files" in str(info.value)
    assert f"b.pte: inode is {ino}, the journal recorded " in str(info.value)
    assert snapshot(tmp_path) == before


def test_a_new_file_rewritten_in_place_is_refused_by_name(tmp_path):
    """``cp`` (or upstream's writer) over the already renamed a.ptd: its size differs."""
    folder = str(tmp_path)
    path, _, _ = half_published(folder)
    (tmp_path / "a.ptd").write_bytes(b"written by another program")
    before = snapshot(tmp_path)
    with pytest.raises(journal.RecoveryError, match=r"a\.ptd: size is 26, the journal recorded 9"):
        journal.recover(folder)
    assert snapshot(tmp_path) == before and os.path.exists(path)


def test_an_old_file_rewritten_in_place_with_the_same_size_is_refused(tmp_path):
    """A lost temp file means roll back, which would put the backup over b.pte: not
    once b.pte was rewritten in place (same size, new change time)."""
    folder = str(tmp_path)
    path, temps, _ = half_published(folder)
    os.unlink(temps[1])
    time.sleep(0.05)  # past the file system's timestamp granularity
    with open(tmp_path / "b.pte", "r+b") as f:
        f.write(b"OLD")
    before = snapshot(tmp_path)
    with pytest.raises(journal.RecoveryError, match=r"b\.pte: (change|modification) time \(ns\) is \d+, the "
                                                    r"journal recorded \d+"):
        journal.recover(folder)
    assert snapshot(tmp_path) == before and os.path.exists(path)


# --- a damaged journal ---------------------------------------------------------------------------


def data_store(*tags):
    store = StreamingNamedDataStore()
    for i, tag in enumerate(tags):
        store.add_named_data(f"k{i}", bytes([i + 1]) * 16, external_tag=tag)
    return store


def test_a_truncated_journal_keeps_every_file_and_unrelated_saves_still_work(tmp_path):
    folder = str(tmp_path)
    path, temps, backups = half_published(folder, ("w.ptd", "v.ptd"))
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    before = snapshot(tmp_path)
    for _ in range(2):  # recover, and a writer's own cleanup, keep the only copies
        with pytest.raises(journal.RecoveryError, match=rf"journal {path}: unreadable"):
            journal.recover(folder)
        assert snapshot(tmp_path) == before
    write_data_files(data_store("x", "y"), folder)  # an unrelated set
    after = snapshot(tmp_path)
    assert sorted(set(after) - set(before)) == [str(tmp_path / "x.ptd"), str(tmp_path / "y.ptd")]
    assert {k: after[k] for k in before} == before
    # A save of a file the damaged journal may name is refused by name, nothing published.
    with pytest.raises(journal.RecoveryError, match=rf"{tmp_path / 'w.ptd'} not written .*journal {path}: "
                                                    r"unreadable"):
        write_data_files(data_store("w", "z"), folder)
    assert {k: v for k, v in snapshot(tmp_path).items()} == after


# --- a planted journal of 200,000 brackets and an oversized one ---------------------------------


@pytest.mark.parametrize("data, reason", [
    (b"[" * 200_000, "nested deeper than the 4 levels of a journal"),
    (b" " * (1 << 20) + b'{"ptdstream_journal": 2, "entries": []}', "more than the 1048576 a journal may hold"),
    (b'"' + b'\\"' * 349_000, "JSONDecodeError: Unterminated string"),  # no quadratic scan of the strings
], ids=["deep", "large", "escaped quotes"])
def test_a_planted_journal_is_one_clear_error_and_the_folder_stays_usable(tmp_path, data, reason):
    path = tmp_path / JNAME
    path.write_bytes(data)
    assert journal.unrecovered(str(tmp_path)) == [journal.PendingSet(str(path), ())]
    start = time.process_time()  # CPU seconds: the work done, not the machine's load
    with pytest.raises(journal.RecoveryError) as info:
        journal.recover(str(tmp_path))
    assert time.process_time() - start < 10.0
    assert str(info.value).startswith(f"journal {path}: unreadable (") and reason in str(info.value)
    write_data_files(data_store("x", "y"), str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [JNAME, "x.ptd", "y.ptd"]
    assert path.read_bytes() == data


def test_a_backup_that_is_a_symlink_out_of_the_folder_is_refused(outside):
    """Rolled back, it would become the target: the next save would write through it."""
    folder, victim = outside
    backup = os.path.join(folder, ".b.pte.ptdstream-1-00000002.bak")
    os.symlink(victim, backup)
    os.link(backup, os.path.join(folder, "b.pte"), follow_symlinks=False)  # target and backup: one inode
    st = os.lstat(backup)
    old = {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "ctime_ns": st.st_ctime_ns,
           "mtime_ns": st.st_mtime_ns}
    fst = os.stat(folder)
    path = os.path.join(folder, JNAME)
    with open(path, "w") as f:  # every state recorded as the planted files are
        json.dump({"ptdstream_journal": journal.JOURNAL_VERSION, "folder": [fst.st_dev, fst.st_ino], "main": None,
                   "members": [], "entries": [dict(row("b.pte", ".b.pte.ptdstream-1-00000001.tmp", ident=(1, 1),
                                                       backup=os.path.basename(backup)), old=old)]}, f)
    before = snapshot(os.path.dirname(folder))
    with pytest.raises(journal.RecoveryError, match=r"\.b\.pte\.ptdstream-1-00000002\.bak: not a regular file"):
        journal.recover(folder)
    assert snapshot(os.path.dirname(folder)) == before
