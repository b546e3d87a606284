"""A journal is proof only of what ptdstream itself wrote (issue 32, item 1).

Planted journals of each shape the issue names, each consistent with itself and
with ``lstat``: a victim named as the "new file" of a target that had none, a
planted temp file rolled forward over a victim, a journal that compares nothing
(``folder: [0, 0]``, null states), a journal of another user in a sticky shared
folder (two uids, run as root), a journal writable by others, and a file system
without extended attributes. Each must leave the victim as it was, through
``recover`` and through a later save into the folder, and say why.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
import tempfile

import pytest
from _journals import killed_set
from _procs import wait_status

from ptdstream import ChunkedFileSink, StreamingNamedDataStore
from ptdstream.save import write_data_files
from ptdstream.write import journal, tempfiles

MARK_ATTR = "user.ptdstream.mark"  # as docs/guarantees.md names it: a planter knows it too
VICTIM = b"the user's own notes, never written by ptdstream"


def snapshot(root) -> dict:
    """Every file under ``root`` with its bytes (links as their text)."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            out[path] = ("link", os.readlink(path)) if os.path.islink(path) else open(path, "rb").read()
    return out


def state(path) -> dict:
    st = os.lstat(path)
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "ctime_ns": st.st_ctime_ns,
            "mtime_ns": st.st_mtime_ns}


def fake_state(dev=1, ino=1, size=0) -> dict:
    return {"dev": dev, "ino": ino, "size": size, "ctime_ns": 0, "mtime_ns": 0}


def entry(target, temp, *, new, old=None, had_target=False, backup=None, mark=None) -> dict:
    """A journal row of the format this ptdstream reads (the planter writes that)."""
    row = {"target": target, "temp": temp, "backup": backup, "had_target": had_target,
           "dev": new["dev"] if new else 1, "ino": new["ino"] if new else 1, "new": new, "old": old}
    if journal.JOURNAL_VERSION >= 4:
        row["mark"] = mark
    return row


def plant(folder, rows, *, folder_id=None) -> str:
    """A planted journal named from its last target, recording ``folder_id``
    (default: the folder's own device and inode)."""
    st = os.stat(folder)
    last = tempfiles.stem(rows[-1]["target"])
    path = os.path.join(folder, f".{last}.ptdstream-4242-0badf00d.journal")
    doc = {"ptdstream_journal": journal.JOURNAL_VERSION, "entries": rows, "main": None, "members": [],
           "folder": list(folder_id) if folder_id is not None else [st.st_dev, st.st_ino]}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # readable by the owner it aims at
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    return path


def victim_as_new(folder) -> list[dict]:
    """The victim named as the new file of a target that had none (its own state),
    and a second entry whose temp file is lost, so that recovery rolls back."""
    victim = os.path.join(folder, "notes.txt")
    return [entry("notes.txt", ".notes.txt.ptdstream-4242-00000001.tmp", new=state(victim),
                  mark=secrets.token_hex(16)),
            entry("zz.ptd", ".zz.ptd.ptdstream-4242-00000002.tmp", new=fake_state(), mark=secrets.token_hex(16))]


def planted_temp(folder, mark_it: str | None) -> list[dict]:
    """A planted temp file recorded as it is, rolled forward over the victim."""
    victim = os.path.join(folder, "notes.txt")
    temp = os.path.join(folder, ".notes.txt.ptdstream-4242-00000001.tmp")
    with open(temp, "wb") as f:
        f.write(b"the planter's bytes")
    mark = secrets.token_hex(16)
    if mark_it == "the journal's mark":
        os.setxattr(temp, MARK_ATTR, mark.encode())
    elif mark_it == "another mark":
        os.setxattr(temp, MARK_ATTR, secrets.token_hex(16).encode())
    return [entry("notes.txt", os.path.basename(temp), new=state(temp), old=state(victim), had_target=True,
                  mark=mark)]


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(VICTIM)
    return str(tmp_path), str(path)


def refusal(fn) -> str:
    """What ``fn()`` raised as a RecoveryError's text, or what it returned (checked after the files are)."""
    try:
        return f"done: {fn()}"
    except journal.RecoveryError as e:
        return str(e)


def save_unrelated(folder):
    """A later save into the folder, of another file: its folder step runs recovery."""
    with ChunkedFileSink(os.path.join(folder, "other.bin")) as sink:
        sink.write(b"unrelated")


# --- shape 1: the victim named as the new file of a target that had none ---------------------------------------


@pytest.mark.parametrize("through", ["recover", "a later save"])
def test_a_victim_named_as_a_new_file_is_not_removed(victim, through):
    folder, path = victim
    jpath = plant(folder, victim_as_new(folder))
    said = refusal(lambda: journal.recover(folder) if through == "recover" else save_unrelated(folder))
    assert os.path.exists(path) and open(path, "rb").read() == VICTIM
    assert os.path.exists(jpath)
    if through == "recover":
        assert said.startswith(
            f"journal {jpath}: cannot prove that the files recovery would act on are its save's own (notes.txt: "
            f"carries no ptdstream mark); recovery would roll the set back (replacing or removing the new files at "
            f"the targets' names); refused: the journal and every file are left as they are, none touched")
    else:
        assert said == "done: None" and open(os.path.join(folder, "other.bin"), "rb").read() == b"unrelated"


# --- shape 2: a planted temp file rolled forward over the victim -----------------------------------------------


@pytest.mark.parametrize("mark_it, why", [(None, "carries no ptdstream mark"),
                                          ("another mark", "carries another mark than the journal's")])
@pytest.mark.parametrize("through", ["recover", "a later save"])
def test_a_planted_temp_file_is_not_rolled_forward_over_a_victim(victim, mark_it, why, through):
    folder, path = victim
    jpath = plant(folder, planted_temp(folder, mark_it))
    before = snapshot(folder)
    said = refusal(lambda: journal.recover(folder) if through == "recover" else save_unrelated(folder))
    assert open(path, "rb").read() == VICTIM
    if through == "recover":
        assert snapshot(folder) == before
        assert said.startswith(
            f"journal {jpath}: cannot prove that the files recovery would act on are its save's own "
            f"(.notes.txt.ptdstream-4242-00000001.tmp: {why}); recovery would roll the set forward (renaming the "
            f"temp files over their targets); refused")


# --- shape 3: a journal that compares nothing --------------------------------------------------------------------


def planted_backup(folder, shape):
    """``folder: [0, 0]`` (a "copied folder", where only sizes were compared) and
    null or fitted states, a planted backup of the victim's size to put back."""
    backup = os.path.join(folder, ".notes.txt.ptdstream-4242-00000002.bak")
    with open(backup, "wb") as f:
        f.write(b"P" * len(VICTIM))
    new, old = (None, None) if shape == "null states" else (fake_state(7, 7, len(VICTIM)), state(backup))
    rows = [entry("notes.txt", ".notes.txt.ptdstream-4242-00000001.tmp", new=new, old=old, had_target=True,
                  backup=os.path.basename(backup), mark=secrets.token_hex(16))]
    return plant(folder, rows, folder_id=(0, 0))


@pytest.mark.parametrize("shape", ["null states", "sizes fitted"])
def test_a_journal_of_folder_0_0_puts_no_planted_backup_in_place(victim, shape):
    folder, path = victim
    jpath = planted_backup(folder, shape)
    before = snapshot(folder)
    st = os.stat(folder)
    said = refusal(lambda: journal.recover(folder))
    assert open(path, "rb").read() == VICTIM
    assert said.startswith(
        f"journal {jpath}: folder [0, 0] is not the device and inode of the folder it lies in "
        f"{[st.st_dev, st.st_ino]} (a journal copied from another folder, or planted); refused: the journal and "
        f"every file are left in place, none touched")
    assert snapshot(folder) == before
    save_unrelated(folder)
    assert open(path, "rb").read() == VICTIM


@pytest.mark.parametrize("field, change, message", [
    ("new", None, "entry 0: new is null, not a file state (a journal must record what it would compare)"),
    ("old", None, "entry 0: old is null, not a file state (a journal must record what it would compare)"),
    ("dev", 99, "entry 0: new is the state of device/inode"),
    ("mark", "x" * 32, "entry 0: mark 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' is neither null nor 32 lowercase hex digits"),
])
def test_a_journal_leaving_a_state_out_is_refused_naming_the_field(victim, field, change, message):
    folder, path = victim
    backup = os.path.join(folder, ".notes.txt.ptdstream-4242-00000002.bak")
    os.link(path, backup)
    row = entry("notes.txt", ".notes.txt.ptdstream-4242-00000001.tmp", new=fake_state(), old=state(path),
                had_target=True, backup=os.path.basename(backup), mark=secrets.token_hex(16))
    row[field] = change
    jpath = plant(folder, [row])
    before = snapshot(folder)
    with pytest.raises(journal.RecoveryError) as info:
        journal.recover(folder)
    assert str(info.value).startswith(f"journal {jpath}: {message}")
    assert snapshot(folder) == before


# --- a journal another user wrote or could have written ----------------------------------------------------------


def half_published(folder):
    """A save of a.ptd and b.pte killed between its two renames."""
    [jpath], entries = killed_set([os.path.join(folder, "a.ptd"), os.path.join(folder, "b.pte")])
    return jpath, entries


def test_a_genuine_journal_records_each_temp_files_mark_and_is_0600(tmp_path):
    jpath, entries = half_published(str(tmp_path))
    assert stat.S_IMODE(os.lstat(jpath).st_mode) == 0o600
    rows = json.load(open(jpath))["entries"]
    carried = [os.getxattr(entries[0].target, MARK_ATTR).decode(), os.getxattr(entries[1].temp, MARK_ATTR).decode()]
    assert all(m is not None and len(m) == 32 for m in carried) and carried[0] != carried[1]
    assert [r["mark"] for r in rows] == carried
    assert journal.recover(str(tmp_path)) == [(jpath, "forward")]
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == {"a.ptd": b"new a.ptd",
                                                                             "b.pte": b"new b.pte"}


@pytest.mark.parametrize("how", ["group-writable", "writable by others", "another owner"])
def test_a_journal_writable_by_others_or_of_another_owner_is_refused(tmp_path, how):
    if how == "another owner" and os.geteuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    jpath, _ = half_published(str(tmp_path))
    if how == "another owner":
        os.chown(jpath, 40123, 40123)
        why = (f"owned by uid 40123, not by this process's effective uid {os.geteuid()} (a journal is the word of "
               f"the user whose save wrote it: run recover as uid 40123)")
    else:
        mode = 0o620 if how == "group-writable" else 0o602
        os.chmod(jpath, mode)
        why = f"mode {mode:#o} lets its group or others write it (a journal ptdstream writes is 0o600)"
    before = snapshot(tmp_path)
    with pytest.raises(journal.RecoveryError) as info:
        journal.recover(str(tmp_path))
    assert str(info.value).startswith(f"journal {jpath}: {why}; refused: the journal and every file are left in "
                                      f"place, none touched")
    assert snapshot(tmp_path) == before


# --- a sticky shared folder, two users -------------------------------------------------------------------------

OWNER, PLANTER = 40001, 40002


def as_uid(uid, fn) -> tuple[int, str]:
    """Run ``fn()`` in a child as ``uid`` (root drops to it); its exit code and what it returned, as text."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_fd)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            os.write(write_fd, str(fn()).encode())
            code = 0
        except BaseException as e:  # noqa: BLE001 - the parent reads the text and the code
            os.write(write_fd, f"{type(e).__name__}: {e}".encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    status = wait_status(pid, 120.0)
    with os.fdopen(read_fd, "rb") as f:
        text = f.read().decode()
    return os.waitstatus_to_exitcode(status), text


@pytest.fixture
def sticky():
    if os.geteuid() != 0:
        pytest.skip("two uids in one sticky folder need root to switch uid (os.setuid)")
    folder = tempfile.mkdtemp(prefix="ptdstream-sticky-", dir="/tmp")  # pytest's own tmp is 0700
    os.chmod(folder, 0o1777)
    yield folder
    shutil.rmtree(folder)


@pytest.mark.parametrize("owner", ["root", "uid 40001"])
@pytest.mark.parametrize("shape", ["victim as new", "planted temp"])
def test_a_journal_planted_in_a_sticky_folder_deletes_nothing_of_the_owner(sticky, owner, shape):
    """The planter cannot remove the owner's file (EPERM); a journal it plants must
    not make the owner's own recover, or the owner's next save, do it for it."""
    uid = None if owner == "root" else OWNER
    path = os.path.join(sticky, "notes.txt")

    def make_victim():
        with open(path, "wb") as f:
            f.write(VICTIM)
        return "made"

    assert as_uid(uid, make_victim) == (0, "made")

    def planter():
        try:
            os.unlink(path)
        except PermissionError:
            pass
        else:
            raise AssertionError("the planter could remove the victim itself")
        rows = victim_as_new(sticky) if shape == "victim as new" else planted_temp(sticky, "the journal's mark")
        return plant(sticky, rows)

    code, jpath = as_uid(PLANTER, planter)
    assert code == 0, jpath
    code, said = as_uid(uid, lambda: refusal(lambda: journal.recover(sticky)))
    expected_uid = 0 if uid is None else uid
    assert os.path.exists(path) and open(path, "rb").read() == VICTIM
    assert (code, said) == (0, (
        f"journal {jpath}: owned by uid {PLANTER}, not by this process's effective uid "
        f"{expected_uid} (a journal is the word of the user whose save wrote it: run recover as uid {PLANTER}); "
        f"refused: the journal and every file are left in place, none touched (a ptdstream journal names only "
        f"files of its own folder; remove it by hand if no save of yours was killed in {sticky})"))
    assert as_uid(uid, lambda: save_unrelated(sticky))[0] == 0
    assert open(path, "rb").read() == VICTIM
    assert os.lstat(path).st_uid == expected_uid


def test_another_users_leftover_in_a_sticky_folder_does_not_stop_a_save(sticky):
    """A dead-looking temp file of another user (an unlocked ``.tmp``): the owner's
    folder step leaves it (EPERM was raised out of the save) and the save goes on."""
    def leftover():
        temp = os.path.join(sticky, ".model.pte.ptdstream-1-00000001.tmp")
        with open(temp, "wb") as f:
            f.write(b"another user's")
        return temp

    code, temp = as_uid(PLANTER, leftover)
    assert code == 0, temp
    code, said = as_uid(OWNER, lambda: save_unrelated(sticky))
    assert (code, said) == (0, "None")
    assert open(temp, "rb").read() == b"another user's"
    assert open(os.path.join(sticky, "other.bin"), "rb").read() == b"unrelated"


def _others_can_read(path: str) -> bool:
    """Whether a uid other than the file's owner and group may read ``path``: every folder above it
    searchable by others, the file readable by others (mode bits; root's ``os.access`` says yes)."""
    path = os.path.realpath(path)
    folders = [os.path.dirname(path)]
    while folders[-1] != os.path.dirname(folders[-1]):
        folders.append(os.path.dirname(folders[-1]))
    return all(os.stat(d).st_mode & 0o001 for d in folders) and bool(os.stat(path).st_mode & 0o004)


def test_another_users_journal_naming_a_file_does_not_stop_the_owners_save_of_it(sticky, tmp_path):
    """A planted journal named after the owner's file (refused: another user's)
    neither acts nor blocks: the owner's save of a set holding that file goes on."""
    import executorch.extension.flat_tensor.serialize as flat_tensor_serialize

    schema = os.path.join(os.path.dirname(flat_tensor_serialize.__file__), "flat_tensor.fbs")
    if not _others_can_read(schema):  # upstream's FlatTensor serializer reads it at every .ptd written
        pytest.skip(f"uid {OWNER} cannot read {schema} (a checkout or virtualenv under a folder "
                    "closed to other users, such as mktemp -d's): its save of a .ptd would fail there")
    def planter():
        path = os.path.join(sticky, ".w.ptd.ptdstream-1-00000000.journal")
        with open(path, "w") as f:
            f.write("{")
        return path

    code, jpath = as_uid(PLANTER, planter)
    assert code == 0, jpath

    def save(folder):
        store = StreamingNamedDataStore()
        store.add_named_data("k", b"\x01" * 16, external_tag="w")
        store.add_named_data("j", b"\x02" * 16, external_tag="v")
        write_data_files(store, folder)
        return "saved"

    save(str(tmp_path))  # every module a save imports, imported here: the other uid cannot read root's venv
    assert as_uid(OWNER, lambda: save(sticky)) == (0, "saved")
    assert sorted(os.listdir(sticky)) == [os.path.basename(jpath), "v.ptd", "w.ptd"]
    assert open(jpath).read() == "{"


# --- a file system without extended attributes -------------------------------------------------------------------


def no_xattrs(monkeypatch, *calls):
    def enotsup(*args, **kwargs):
        raise OSError(errno.ENOTSUP, "Operation not supported")

    for call in calls:
        monkeypatch.setattr(os, call, enotsup)


@pytest.mark.parametrize("when", ["when saving and recovering", "when recovering only"])
def test_without_extended_attributes_the_files_are_left_and_it_says_so(tmp_path, monkeypatch, when):
    if when == "when saving and recovering":
        no_xattrs(monkeypatch, "setxattr", "getxattr")
        why = "the journal recorded no mark (the file system took no extended attribute when the save ran)"
    else:
        why = "its mark cannot be read: the file system has no extended attributes (ENOTSUP)"
    jpath, _ = half_published(str(tmp_path))
    no_xattrs(monkeypatch, "setxattr", "getxattr")
    before = snapshot(tmp_path)
    with pytest.raises(journal.RecoveryError) as info:
        journal.recover(str(tmp_path))
    temp_b = os.path.basename(json.load(open(jpath))["entries"][1]["temp"])
    assert str(info.value) == (
        f"journal {jpath}: cannot prove that the files recovery would act on are its save's own ({temp_b}: {why}); "
        f"recovery would roll the set forward (renaming the temp files over their targets); refused: the journal "
        f"and every file are left as they are, none touched; check the files in {tmp_path} (complete or undo the "
        f"set by hand), then remove the journal")
    assert snapshot(tmp_path) == before


def test_without_extended_attributes_a_kill_before_any_rename_still_rolls_back(tmp_path, monkeypatch):
    """Rolling back where no new file reached its target replaces and removes no
    file at a target's name: it needs no mark."""
    no_xattrs(monkeypatch, "setxattr", "getxattr")
    [jpath], entries = killed_set([tmp_path / "a.ptd", tmp_path / "b.pte"], renamed=0)
    os.unlink(entries[1].temp)  # a temp file lost: back
    assert journal.recover(str(tmp_path)) == [(jpath, "back")]
    assert sorted(os.listdir(tmp_path)) == ["a.ptd", "b.pte"]
