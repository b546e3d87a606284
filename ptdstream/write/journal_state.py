"""Whether a journal's files are still the ones it recorded and the save's own, checked before recovery touches any.

Every target must be a regular file, or absent: never a directory, a symbolic
link, a fifo, a socket or a device (:func:`check_on_disk` refuses naming the
journal, the entry and what the target is). ptdstream publishes regular files
only, over the file a symlinked target names (resolved before the save).

After a killed save another program (``mv``, ``cp``, upstream's writer) may
write into the folder; completing the journal then would roll its set over those
newer files. :func:`check_on_disk` compares each file with the journal's record
and refuses by name (file, field, both values):

- a temp file still at its name is the recorded one: device, inode, size,
  change and modification time;
- a target is absent only when there was none before the save; otherwise it is
  the recorded temp file (renamed: device, inode, size, modification time; the
  rename changed its change time), or the recorded previous file (device, inode,
  size, modification time, and change time while its backup link is there);
- a backup is the recorded previous file (device, inode, size, modification time);
- a temp file or backup is a regular file (not a link, which recovery would
  move over the target);
- a name the save freed (a temp file already renamed, a backup already removed)
  that another uid's file now holds (in a sticky folder anyone may create it)
  counts as gone: that file is not compared, moved or removed, and stops no
  recovery.

A journal that matches its files is still only the word of whoever wrote it:
:func:`check_proofs` then requires, of every file recovery would rename over a
target (a temp file, rolling forward) and of every file at a target's name it
would replace or remove (the new file, rolling back), that it is owned by this
process's effective uid and carries the mark the journal recorded
(:mod:`ptdstream.system.marks`), else it refuses, naming each file and why
(no mark, another mark, a file system without extended attributes).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from ..errors import RecoveryError
from ..system import marks
from .journal_codec import FileState, Journal, JournalEntry, state_of

__all__ = ["backup_there", "check_on_disk", "check_proofs"]

_FIELDS = (("dev", "device"), ("ino", "inode"), ("size", "size"), ("ctime_ns", "change time (ns)"),
           ("mtime_ns", "modification time (ns)"))
_FIELD_KEYS = tuple(key for key, _ in _FIELDS)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(path: str) -> str | None:
    """What ``path`` is when it is there and not a regular file (not following a link)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link to {os.readlink(path)!r}"
        except OSError:
            return "a symbolic link"
    return next((label for test, label in _KINDS if test(mode)), f"a file of mode {stat.S_IFMT(mode):#o}")


def _check_kinds(journal: Journal) -> None:
    """Raise unless each target of ``journal`` is a regular file or absent."""
    for index, entry in enumerate(journal.entries):
        kind = _kind(entry.target)
        if kind is not None:
            folder = os.path.dirname(journal.path)
            raise RecoveryError(
                f"journal {journal.path}: entry {index}: target {os.path.basename(entry.target)!r} is {kind}, "
                f"not a regular file (a journal's targets are files ptdstream writes); refused: the journal "
                f"and every file are left as they are, none touched; check the files in {folder}, then "
                f"remove the journal by hand")


_BACKUP_FIELDS = ("dev", "ino", "size", "mtime_ns")


def _foreign(path: str | None, recorded: FileState | None, fields: Sequence[str]) -> bool:
    """Whether ``path`` holds another uid's file that is not the ``recorded`` one (on
    ``fields``): a name the save freed (a temp file renamed, a backup removed) that
    another user filled in a sticky folder, a recycled inode number included. It is
    not the save's, and not the save's to touch."""
    if path is None:
        return False
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if st.st_uid == os.geteuid():
        return False
    disk = FileState(st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns, st.st_mtime_ns)
    return recorded is None or _differs(disk, recorded, fields) is not None


def _ours(path: str | None, recorded: FileState | None, fields: Sequence[str]) -> FileState | None:
    """``state_of(path)``, or ``None`` when absent or :func:`_foreign`."""
    return None if path is None or _foreign(path, recorded, fields) else state_of(path)


def backup_there(entry: JournalEntry) -> bool:
    """Whether ``entry``'s backup is at its name: the recorded previous file (device,
    inode, size, modification time), or any file for an entry whose states are not
    recorded yet (a live publication's own backup)."""
    if entry.backup is None:
        return False
    if entry.old is None:
        return os.path.lexists(entry.backup)
    backup = state_of(entry.backup)
    return backup is not None and _differs(backup, entry.old, _BACKUP_FIELDS) is None


def _differs(disk: FileState, recorded: FileState, fields: Sequence[str]) -> tuple[str, int, int] | None:
    for key, label in _FIELDS:
        if key in fields and getattr(disk, key) != getattr(recorded, key):
            return label, getattr(recorded, key), getattr(disk, key)
    return None


def _not_own(entry: JournalEntry) -> list[str]:
    """A temp file or backup that is not a regular file, as ``"<file>: ..."`` phrases."""
    out = []
    for path, recorded, fields in ((entry.temp, entry.new, _FIELD_KEYS), (entry.backup, entry.old, _BACKUP_FIELDS)):
        # ptdstream's own: never a link, a folder or a device (another user's file there is not its own)
        if path is not None and _kind(path) is not None and not _foreign(path, recorded, fields):
            out.append(f"{os.path.basename(path)}: not a regular file (a ptdstream temp or backup file is one)")
    return out


def _problems(entry: JournalEntry) -> list[str]:
    """What differs for one entry, as ``"<file>: <field> ..."`` phrases."""
    name = os.path.basename(entry.target)
    target, temp = state_of(entry.target), _ours(entry.temp, entry.new, _FIELD_KEYS)
    backup = _ours(entry.backup, entry.old, _BACKUP_FIELDS)
    new, old = entry.new, entry.old
    out: list[str] = []

    def compare(what: str, disk: FileState | None, recorded: FileState | None, fields: Sequence[str]) -> None:
        if disk is None or recorded is None:
            return
        diff = _differs(disk, recorded, fields)
        if diff is not None:
            out.append(f"{what}: {diff[0]} is {diff[2]}, the journal recorded {diff[1]}")

    compare(os.path.basename(entry.temp), temp, new, _FIELD_KEYS)
    if entry.backup is not None:
        compare(os.path.basename(entry.backup), backup, old, _BACKUP_FIELDS)
    if target is None:
        if entry.had_target:
            out.append(f"{name}: missing, the journal recorded a file there")
        return out
    ident = (target.dev, target.ino)
    if ident == (entry.dev, entry.ino):
        compare(name, target, new, ("size", "mtime_ns"))
    elif old is not None and ident == (old.dev, old.ino):
        fields = ("size", "mtime_ns") + (("ctime_ns",) if entry.backup is None or backup is not None else ())
        compare(name, target, old, fields)
    else:
        was = [str(entry.ino) + " (the new file)"] + ([f"{old.ino} (the previous file)"] if old else ["no file"])
        out.append(f"{name}: inode is {target.ino}, the journal recorded {' or '.join(was)}")
    return out


def check_on_disk(journal: Journal) -> None:
    """Raise unless every target of ``journal`` is a regular file or absent and
    every file is one it recorded (module docstring). Reads only.

    Raises:
        RecoveryError: naming the journal and the entry whose target is not a
            regular file and what it is, or each file and field that differs with
            both values; the journal and every file are left as they are.
    """
    folder = os.path.dirname(journal.path)
    problems = [p for e in journal.entries for p in _not_own(e)]
    if not problems:
        _check_kinds(journal)
        problems = [p for e in journal.entries for p in _problems(e)]
    if problems:
        raise RecoveryError(
            f"journal {journal.path}: another program changed the set's files since the save was killed "
            f"({'; '.join(problems)}); refused: the journal and every file are left as they are, none "
            f"touched; check the files in {folder}, then remove the journal by hand")


def _acted_on(entry: JournalEntry, forward: bool) -> str | None:
    """The file of ``entry`` that recovery would rename over the target (forward:
    the temp file, where it still is the recorded one) or replace or remove at the
    target's name (back: the new file, where it got there), or ``None``."""
    ident = (entry.dev, entry.ino)
    if forward:
        temp = state_of(entry.temp)
        return entry.temp if temp is not None and (temp.dev, temp.ino) == ident else None
    target = state_of(entry.target)
    if target is None or (target.dev, target.ino) != ident:
        return None
    if backup_there(entry):
        return entry.target  # the backup would be put back over it
    return entry.target if not entry.had_target else None  # removed: no previous file


def _unproven(path: str, mark: str | None) -> str | None:
    """Why ``path`` cannot be proven the save's own, or ``None``."""
    try:
        uid = os.lstat(path).st_uid
    except OSError as e:
        return f"cannot be read ({type(e).__name__}: {e})"
    if uid != os.geteuid():
        return f"owned by uid {uid}, not by this process's effective uid {os.geteuid()}"
    return marks.why_unmarked(path, mark)


def check_proofs(journal: Journal, forward: bool) -> None:
    """Raise unless every file that completing ``journal`` ``forward`` (or back)
    would move over a target, or replace or remove at a target's name, is owned
    by this process's effective uid and carries the journal's mark (module
    docstring). Call after :func:`check_on_disk`. Reads only.

    Raises:
        RecoveryError: naming the journal, each such file and why it is not
            proven (no mark, another mark, no extended attributes, another
            owner); the journal and every file are left as they are.
    """
    problems = []
    for entry in journal.entries:
        path = _acted_on(entry, forward)
        why = None if path is None else _unproven(path, entry.mark)
        if path is not None and why is not None:
            problems.append(f"{os.path.basename(path)}: {why}")
    if problems:
        folder = os.path.dirname(journal.path)
        way = "forward (renaming the temp files over their targets)" if forward else \
            "back (replacing or removing the new files at the targets' names)"
        raise RecoveryError(
            f"journal {journal.path}: cannot prove that the files recovery would act on are its save's own "
            f"({'; '.join(problems)}); recovery would roll the set {way}; refused: the journal and every file "
            f"are left as they are, none touched; check the files in {folder} (complete or undo the set by hand), "
            f"then remove the journal")
