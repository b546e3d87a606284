"""Attacks on a save's folder by someone who can write into it: another uid in a
sticky (1777) folder, or the saving user's own planted files (journals of any
shape, hard links, symlinks, FIFOs, locks). Each test names the attack and
asserts that the victim file survives byte-identical and that ptdstream refuses
with a clear error or leaves it (docs/guarantees.md, "What a journal can and
cannot make ptdstream do").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import tempfile

import pytest
from _journals import killed_set
from _procs import fork, killed_at, wait_status

from ptdstream.cli import main
from ptdstream.errors import RecoveryError
from ptdstream.system import marks
from ptdstream.write import journal, tempfiles
from ptdstream.write.sink import ChunkedFileSink

ATTACKER = 40002
VICTIM = b"the victim's bytes, not ptdstream's"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="acts as another uid: needs root")


@pytest.fixture
def base():
    """A folder every uid can enter (pytest's own tmp is 0700)."""
    path = tempfile.mkdtemp(prefix="ptdstream-attack-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def shared(base):
    """A sticky folder every uid can write into, like /tmp."""
    path = os.path.join(base, "shared")
    os.mkdir(path)
    os.chmod(path, 0o1777)
    return path


def victim(path, data: bytes = VICTIM, mode: int = 0o644) -> str:
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
    return str(path)


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def as_attacker(fn) -> None:
    """Run ``fn`` in a child acting as uid/gid ``ATTACKER``; it must succeed."""

    def child():
        os.setgroups([])
        os.setgid(ATTACKER)
        os.setuid(ATTACKER)
        fn()

    assert os.waitstatus_to_exitcode(wait_status(fork(child))) == 0


@contextlib.contextmanager
def attacker_holding_lock(path):
    """An ``ATTACKER`` child holding an exclusive ``flock`` on ``path`` (a file or a folder)
    for the ``with`` block."""
    r, w = os.pipe()
    holder = os.fork()
    if holder == 0:
        try:
            os.setgroups([])
            os.setgid(ATTACKER)
            os.setuid(ATTACKER)
            fcntl.flock(os.open(path, os.O_RDONLY), fcntl.LOCK_EX)
            os.write(w, b"x")
            signal.pause()
        finally:
            os._exit(1)
    try:
        assert os.read(r, 1) == b"x"
        yield
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
        os.close(r)
        os.close(w)


def write(path, data: bytes) -> None:
    with ChunkedFileSink(str(path)) as sink:
        sink.write(data)


def genuine_journal(folder) -> tuple[str, list[journal.JournalEntry], dict]:
    """A killed save of two files in ``folder`` (one renamed): its journal, entries and JSON."""
    journals, entries = killed_set([os.path.join(folder, "w.ptd"), os.path.join(folder, "model.pte")])
    return journals[0], entries, json.loads(read(journals[0]))


def plant(path, doc) -> str:
    """A journal of this uid, mode 0600 (as ptdstream writes them), holding ``doc``."""
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, data)
    os.close(fd)
    return str(path)


def journal_name(folder, target: str, pid: int = 99) -> str:
    return os.path.join(folder, f".{target}.ptdstream-{pid}-0000abcd.journal")


# -- links ------------------------------------------------------------------------------------------------


@root_only
@pytest.mark.parametrize("existing", [True, False], ids=["to-a-file", "dangling"])
def test_a_link_another_user_planted_in_a_sticky_folder_is_not_written_through(base, shared, existing):
    # The /tmp symlink attack: a save to shared/model.pte must not replace (or create) the
    # file the other user's link names. The kernel refuses such an open (fs.protected_symlinks);
    # realpath in user space does not.
    os.mkdir(os.path.join(base, "home"))
    precious = os.path.join(base, "home", "precious")
    if existing:
        victim(precious)
    link = os.path.join(shared, "model.pte")
    as_attacker(lambda: os.symlink(precious, link))
    with pytest.raises(PermissionError) as info:
        write(link, b"model bytes")
    assert f"a symbolic link owned by uid {ATTACKER} in the sticky, world-writable folder {shared}" in str(info.value)
    assert os.listdir(os.path.join(base, "home")) == (["precious"] if existing else [])
    if existing:
        assert read(precious) == VICTIM
    assert os.listdir(shared) == ["model.pte"] and os.path.islink(link)


@root_only
def test_a_link_of_ones_own_in_a_sticky_folder_is_still_written_through(base, shared):
    os.mkdir(os.path.join(base, "home"))
    real = victim(os.path.join(base, "home", "model.pte"), b"old")
    os.symlink(real, os.path.join(shared, "model.pte"))
    write(os.path.join(shared, "model.pte"), b"new")
    assert read(real) == b"new"


@root_only
def test_a_chain_whose_second_link_another_user_planted_is_refused(base, shared):
    os.mkdir(os.path.join(base, "home"))
    precious = victim(os.path.join(base, "home", "precious"))
    as_attacker(lambda: os.symlink(precious, os.path.join(shared, "hop")))
    mine = os.path.join(base, "model.pte")
    os.symlink(os.path.join(shared, "hop"), mine)
    with pytest.raises(PermissionError, match="hop: a symbolic link owned by uid"):
        write(mine, b"model bytes")
    assert read(precious) == VICTIM


@root_only
def test_recover_follow_links_skips_another_users_link_in_a_sticky_folder(base, shared, capsys):
    # --follow-links locks, recovers and cleans the folder a link points into: a link another
    # user planted must not extend recover to a folder of the victim's.
    home = os.path.join(base, "home")
    os.mkdir(home)
    leftover = victim(os.path.join(home, ".notes.ptdstream-1-0000abcd.bak"))
    as_attacker(lambda: os.symlink(os.path.join(home, "x.pte"), os.path.join(shared, "x.pte")))
    assert main(["recover", "--follow-links", shared]) == 0
    assert read(leftover) == VICTIM


def test_a_link_loop_at_the_target_is_a_clear_error(tmp_path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(OSError, match="more than 40 symbolic links"):
        write(tmp_path / "a", b"x")
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


# -- another uid's files in a sticky folder ----------------------------------------------------------------


@root_only
def test_another_users_journal_with_a_copied_mark_cannot_replace_a_victim(shared, capsys):
    # The attacker copies the mark of this user's genuine temp file onto a temp file of its
    # own and plants a well-formed journal naming the victim as the file its save replaces.
    precious = victim(os.path.join(shared, "model.pte"))
    temp, fd, lock_fd = tempfiles.create_locked(os.path.join(shared, "other.pte"))
    os.close(fd)
    mark = marks.read_mark(temp)
    st_victim = os.lstat(precious)
    folder_st = os.stat(shared)

    def attack():
        own = os.path.join(shared, ".model.pte.ptdstream-7-0000abcd.tmp")
        with open(own, "wb") as f:
            f.write(b"attacker")
        os.setxattr(own, marks.MARK_ATTR, mark.encode())
        st = os.lstat(own)

        def state(s):
            return {"dev": s.st_dev, "ino": s.st_ino, "size": s.st_size, "ctime_ns": s.st_ctime_ns,
                    "mtime_ns": s.st_mtime_ns}

        doc = {"ptdstream_journal": journal.JOURNAL_VERSION, "folder": [folder_st.st_dev, folder_st.st_ino],
               "main": None, "members": [],
               "entries": [{"target": "model.pte", "temp": os.path.basename(own), "backup": None,
                            "had_target": True, "dev": st.st_dev, "ino": st.st_ino, "mark": mark,
                            "new": state(st), "old": state(st_victim)}]}
        plant(journal_name(shared, "model.pte", 7), doc)

    as_attacker(attack)
    assert main(["recover", shared]) == 1
    assert f"owned by uid {ATTACKER}, not by this process's effective uid 0" in capsys.readouterr().err
    assert read(precious) == VICTIM
    os.close(lock_fd)
    write(os.path.join(shared, "w.ptd"), b"a save beside it goes on")  # another user's journal stops no save
    assert read(os.path.join(shared, "w.ptd")) == b"a save beside it goes on"
    assert read(precious) == VICTIM


@root_only
def test_thousands_of_another_users_journals_cost_a_save_one_pass(shared, monkeypatch):
    # Each journal that stays used to scan the folder (and test the lock of every temp
    # file) once: N planted journals and N temp files made every save do N*N lock tests.
    n = 60

    def attack():
        for i in range(n):
            open(os.path.join(shared, f".m{i}.ptdstream-{i}-0000abcd.journal"), "w").close()
            open(os.path.join(shared, f".m{i}.ptdstream-{i}-0000abce.tmp"), "w").close()

    as_attacker(attack)
    calls = []
    real = tempfiles.is_locked
    monkeypatch.setattr(tempfiles, "is_locked", lambda p: calls.append(p) or real(p))
    with pytest.raises(RecoveryError, match=f"owned by uid {ATTACKER}"):
        journal.recover(shared)
    assert len(calls) <= n
    assert len(os.listdir(shared)) == 2 * n  # another user's files are left to that user


@root_only
def test_a_victim_hard_linked_as_a_backup_loses_only_the_planted_name(shared):
    # protected_hardlinks lets the attacker link a file it can read and write.
    precious = victim(os.path.join(shared, "precious"), mode=0o666)
    bak = os.path.join(shared, ".model.pte.ptdstream-1-0000abcd.bak")
    tmp = os.path.join(shared, ".model.pte.ptdstream-1-0000abce.tmp")
    as_attacker(lambda: (os.link(precious, bak), os.link(precious, tmp)))
    journal.recover(shared)
    assert read(precious) == VICTIM
    assert sorted(os.listdir(shared)) == ["precious"]


@root_only
def test_another_user_holding_a_temp_files_lock_keeps_it_but_changes_nothing(shared):
    stale = victim(os.path.join(shared, ".model.pte.ptdstream-1-0000abcd.tmp"))
    with attacker_holding_lock(stale):  # the stale file looks "live"
        journal.recover(shared)
    assert read(stale) == VICTIM


@root_only
@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="needs /proc/locks to name a lock's holder")
def test_a_folder_lock_held_by_another_user_is_named_not_waited_for(shared):
    """Any uid that can read a folder can flock it for ever: recover and a save into the
    folder name the holder and stop, where they used to wait for it."""
    with attacker_holding_lock(shared):
        for attempt in (lambda: journal.recover(shared), lambda: write(os.path.join(shared, "model.pte"), b"x")):
            with pytest.raises(BlockingIOError, match=rf"^\[Errno 11\] {re.escape(shared)} is locked by another "
                                                      rf"user's process, pid \d+ \(uid {ATTACKER}\): "):
                attempt()
    assert not os.path.exists(os.path.join(shared, "model.pte"))


def test_a_folder_lock_held_by_this_user_is_waited_for(tmp_path):
    """Two saves of one user into one folder take turns: the second waits for the first."""
    from ptdstream.write.tempfiles import folder_lock, lock_holders

    locked_r, locked_w = os.pipe()
    go_r, go_w = os.pipe()
    holder = os.fork()
    if holder == 0:
        try:
            with folder_lock([str(tmp_path)]):
                os.write(locked_w, b"x")
                os.read(go_r, 1)
        finally:
            os._exit(0)
    assert os.read(locked_r, 1) == b"x"
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        assert lock_holders(fd) == [(holder, os.geteuid())]
    finally:
        os.close(fd)
    os.write(go_w, b"g")  # the holder ends once it reads this; the write below waits for it
    write(tmp_path / "model.pte", b"x")
    assert os.waitpid(holder, 0)[1] == 0
    assert (tmp_path / "model.pte").read_bytes() == b"x"
    for fd in (locked_r, locked_w, go_r, go_w):
        os.close(fd)


# -- planted journals (the user's own uid) ---------------------------------------------------------------


def test_a_fifo_named_as_a_journal_is_refused_without_blocking(tmp_path):
    fifo = journal_name(tmp_path, "model.pte")
    os.mkfifo(fifo)
    with pytest.raises(RecoveryError, match="not a regular file"):
        journal.recover(str(tmp_path))
    assert os.listdir(tmp_path) == [os.path.basename(fifo)]


def test_a_fifo_named_as_a_temp_file_is_not_opened_for_good(tmp_path):
    fifo = os.path.join(tmp_path, ".model.pte.ptdstream-1-0000abcd.tmp")
    os.mkfifo(fifo)
    write(tmp_path / "model.pte", b"saved")  # the folder step runs first; it must not block on the fifo
    assert read(tmp_path / "model.pte") == b"saved"


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_journal_that_is_a_link_to_a_victim_is_refused_and_the_victim_kept(tmp_path, how):
    precious = victim(tmp_path / "precious.json", b'{"token": "hunter2"}', mode=0o600)
    name = journal_name(tmp_path, "model.pte")
    (os.symlink if how == "symlink" else os.link)(precious, name)
    with pytest.raises(RecoveryError) as info:
        journal.recover(str(tmp_path))
    assert "refused" in str(info.value) and "hunter2" not in str(info.value)
    assert read(precious) == b'{"token": "hunter2"}'
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(name), "precious.json"])


def _mutated(doc, how, folder):
    doc = json.loads(json.dumps(doc))
    e = doc["entries"][0]
    if how in ("..", "absolute", "subfolder", "nul"):
        e["target"] = {"..": "../precious", "absolute": os.path.join(folder, "precious"),
                       "subfolder": "sub/precious", "nul": "precious\0"}[how]
        return doc
    if how.startswith("version"):
        doc["ptdstream_journal"] = int(how[len("version"):])
        return doc
    if how == "deep":
        return b'{"x": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    if how == "huge":
        return json.dumps(doc).encode() + b" " * (1 << 20)
    if how == "not-an-object":
        return b"[1, 2, 3]"
    if how == "duplicate-keys":  # a second "entries" whose target is the victim
        text = json.dumps(doc)
        bad = json.dumps([dict(e, target="precious")])
        return (text[:-1] + ', "entries": ' + bad + "}").encode()
    if how == "null-states":
        e["new"] = e["old"] = None
        return doc
    if how == "folder-zero":
        doc["folder"] = [0, 0]
        return doc
    if how == "victim-as-temp":
        e["temp"] = "precious"
        return doc
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["..", "absolute", "subfolder", "nul", "version0", "version1", "version3",
                                 "version5", "deep", "huge", "not-an-object", "duplicate-keys", "null-states",
                                 "folder-zero", "victim-as-temp"])
def test_a_planted_journal_of_any_shape_touches_no_victim(tmp_path, how):
    folder = tmp_path / "set"
    folder.mkdir()
    precious = victim(folder / "precious")
    outside = victim(tmp_path / "precious")
    _, _, doc = genuine_journal(str(folder))  # recover completes it beside the planted one
    planted = plant(journal_name(folder, "w.ptd" if how == "duplicate-keys" else "model.pte", 7),
                    _mutated(doc, how, str(folder)))
    with pytest.raises(RecoveryError) as info:
        journal.recover(str(folder))
    assert f"journal {planted}" in str(info.value) and "refused" in str(info.value)
    assert read(precious) == VICTIM and read(outside) == VICTIM and os.path.exists(planted)
    assert read(folder / "w.ptd") == b"new w.ptd" and read(folder / "model.pte") == b"new model.pte"


def test_a_planted_journal_naming_an_unmarked_victim_as_its_new_file_is_refused(tmp_path):
    # Rolling back (a temp file lost) removes a new file that had no previous one: the journal
    # records the victim's inode as "new", so only the mark stands between the victim and unlink.
    precious = victim(tmp_path / "model.pte")
    st = os.lstat(precious)
    state = {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "ctime_ns": st.st_ctime_ns,
             "mtime_ns": st.st_mtime_ns}
    lost = dict(state, ino=st.st_ino + 1)
    folder_st = os.stat(tmp_path)
    row = {"backup": None, "had_target": False, "mark": "0" * 32, "old": None, "dev": st.st_dev}
    doc = {"ptdstream_journal": journal.JOURNAL_VERSION, "folder": [folder_st.st_dev, folder_st.st_ino],
           "main": None, "members": [],
           "entries": [dict(row, target="a.pte", temp=".a.pte.ptdstream-99-0000abce.tmp", ino=lost["ino"], new=lost),
                       dict(row, target="model.pte", temp=".model.pte.ptdstream-99-0000abcf.tmp", ino=st.st_ino,
                            new=state)]}
    plant(journal_name(tmp_path, "model.pte"), doc)
    with pytest.raises(RecoveryError, match="model.pte: carries no ptdstream mark"):
        journal.recover(str(tmp_path))
    assert read(precious) == VICTIM
    os.setxattr(precious, marks.MARK_ATTR, b"1" * 32)  # a mark of another save
    with pytest.raises(RecoveryError, match="model.pte: carries another mark than the journal's"):
        journal.recover(str(tmp_path))
    assert read(precious) == VICTIM


def test_a_genuine_journal_hard_linked_into_another_folder_is_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    name, entries, _ = genuine_journal(str(tmp_path / "a"))
    victims = {n: victim(tmp_path / "b" / n) for n in ("w.ptd", "model.pte")}
    for e in entries:  # the same names beside it, temp files included
        os.link(e.temp if os.path.exists(e.temp) else e.target, tmp_path / "b" / os.path.basename(e.temp))
    os.link(name, tmp_path / "b" / os.path.basename(name))
    with pytest.raises(RecoveryError, match="is not the device and inode of the folder it lies in"):
        journal.recover(str(tmp_path / "b"))
    assert all(read(p) == VICTIM for p in victims.values())


# -- a real kill, then the folder changed --------------------------------------------------------------------


@root_only
def test_a_killed_save_whose_freed_temp_name_another_user_fills_is_refused(shared):
    # One file was renamed before the kill: its temp name is free for anyone in a sticky folder.
    precious = victim(os.path.join(shared, "precious"), mode=0o666)
    name, entries, _ = genuine_journal(shared)
    freed = entries[0].temp
    as_attacker(lambda: os.link(precious, freed))
    with pytest.raises(RecoveryError, match="another program changed the set's files"):
        journal.recover(shared)
    assert read(precious) == VICTIM and os.path.exists(name)
    assert read(entries[0].target) == b"new w.ptd" and read(entries[1].target) == b"old model.pte"


def _publish_two(folder) -> None:
    """Publish ``w.ptd`` and ``model.pte`` ("new ...") into ``folder`` as one set."""
    from ptdstream.write.publish import folder_locks, publish_set

    sinks = []
    for name in ("w.ptd", "model.pte"):
        sink = ChunkedFileSink(os.path.join(folder, name), clean_folder=False)
        sink.write(b"new " + name.encode())
        sink.sync()
        sinks.append(sink)
    with folder_locks([folder]):
        publish_set(sinks)


@root_only
def test_a_save_killed_at_each_publishing_call_then_every_free_name_filled_by_another_user(base):
    # After each kill another user puts a file of its own at every name of the set that is
    # free (a temp file already renamed, a backup already removed), as it sees them in the
    # sticky folder: recovery used to refuse ("another program changed the set's files") and
    # the user, who cannot remove another user's file there, was left with a mixed set.
    # Now such a file counts as gone: recovery completes, the other user's files survive.
    n, killed, filled = 0, True, 0
    while killed:
        n += 1
        folder = os.path.join(base, f"kill{n}")
        os.mkdir(folder)
        os.chmod(folder, 0o1777)
        for name in ("w.ptd", "model.pte"):
            victim(os.path.join(folder, name), b"old " + name.encode())
        killed = killed_at(n, lambda folder=folder: _publish_two(folder))
        names = set()
        for path, _, suffix in tempfiles.temp_files_in(folder):
            if suffix == "journal":
                names |= {os.path.join(folder, r[k]) for r in json.loads(read(path))["entries"]
                          for k in ("temp", "backup") if r[k] is not None}
        free = sorted(p for p in names if not os.path.lexists(p))
        filled += len(free)
        as_attacker(lambda free=free: [victim(p) for p in free])
        journal.recover(folder)
        assert all(read(p) == VICTIM for p in free)
        versions = {read(os.path.join(folder, name)).split()[0] for name in ("w.ptd", "model.pte")}
        assert len(versions) == 1, (n, versions)
        assert sorted(os.listdir(folder)) == sorted(["w.ptd", "model.pte"] + [os.path.basename(p) for p in free])
    assert n > 10 and filled > 5


@root_only
def test_another_user_locking_a_temp_file_just_created_does_not_hang_the_save(shared, monkeypatch):
    # The writer locks its temp file right after creating it (0644: anyone may open it); another
    # user who takes that lock first, watching the folder, and keeps it, used to make the writer
    # wait forever. The race is won here every time: the lock is taken between create and flock.
    taken = []

    class Racing:
        def __getattr__(self, name):
            return getattr(fcntl, name)

        def flock(self, fd, op):
            path = os.readlink(f"/proc/self/fd/{fd}")
            if path.endswith(".tmp") and not taken:
                taken.append(path)
                with attacker_holding_lock(path):
                    try:
                        return fcntl.flock(fd, op | fcntl.LOCK_NB)
                    except BlockingIOError:
                        if not op & fcntl.LOCK_NB:
                            raise AssertionError(f"the writer waits for another user's lock on {path}") from None
                        raise
            return fcntl.flock(fd, op)

    monkeypatch.setattr(tempfiles, "fcntl", Racing())
    write(os.path.join(shared, "model.pte"), b"saved")
    assert taken and read(os.path.join(shared, "model.pte")) == b"saved"
    assert os.listdir(shared) == ["model.pte"]  # the file the other user locked is gone too
