"""Whether a journal's files are still the ones it recorded, checked before recovery touches any.

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
  move over the target).

A version 2 journal recorded only the temp file's device and inode: a target must
then be the temp file or its backup's inode (when the backup is there). A copied
folder (its device and inode differ from the journal's record) has new inodes
everywhere: sizes are compared instead.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from ..errors import RecoveryError
from .journal_codec import FileState, Journal, JournalEntry, state_of

__all__ = ["check_on_disk"]

_FIELDS = (("dev", "device"), ("ino", "inode"), ("size", "size"), ("ctime_ns", "change time (ns)"),
           ("mtime_ns", "modification time (ns)"))


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


def _differs(disk: FileState, recorded: FileState, fields: Sequence[str]) -> tuple[str, int, int] | None:
    for key, label in _FIELDS:
        if key in fields and getattr(disk, key) != getattr(recorded, key):
            return label, getattr(recorded, key), getattr(disk, key)
    return None


def _folder_id(folder: str) -> tuple[int, int] | None:
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _not_own(entry: JournalEntry) -> list[str]:
    """A temp file or backup that is not a regular file, as ``"<file>: ..."`` phrases."""
    out = []
    for path in (entry.temp, entry.backup):  # ptdstream's own: never a link, a folder or a device
        if path is not None and _kind(path) is not None:
            out.append(f"{os.path.basename(path)}: not a regular file (a ptdstream temp or backup file is one)")
    return out


def _problems(entry: JournalEntry, copied: bool) -> list[str]:
    """What differs for one entry, as ``"<file>: <field> ..."`` phrases."""
    name = os.path.basename(entry.target)
    target, temp = state_of(entry.target), state_of(entry.temp)
    backup = state_of(entry.backup) if entry.backup is not None else None
    new, old = entry.new, entry.old
    out: list[str] = []

    def compare(what: str, disk: FileState | None, recorded: FileState | None, fields: Sequence[str]) -> None:
        if disk is None or recorded is None:
            return
        diff = _differs(disk, recorded, fields)
        if diff is not None:
            out.append(f"{what}: {diff[0]} is {diff[2]}, the journal recorded {diff[1]}")

    if copied:  # new inodes everywhere: the sizes still tell the files apart
        compare(os.path.basename(entry.temp), temp, new, ("size",))
        compare(os.path.basename(entry.backup or ""), backup, old, ("size",))
        sizes = {s.size for s in (new, old) if s is not None}
        if target is not None and sizes and target.size not in sizes:
            out.append(f"{name}: size is {target.size}, the journal recorded {' or '.join(map(str, sorted(sizes)))}")
        return out
    if new is not None:
        compare(os.path.basename(entry.temp), temp, new, ("dev", "ino", "size", "ctime_ns", "mtime_ns"))
    elif temp is not None and (temp.dev, temp.ino) != (entry.dev, entry.ino):
        out.append(f"{os.path.basename(entry.temp)}: inode is {temp.ino}, the journal recorded {entry.ino}")
    if backup is not None:
        compare(os.path.basename(entry.backup or ""), backup, old, ("dev", "ino", "size", "mtime_ns"))
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
    elif old is None and new is None and (backup is None or ident == (backup.dev, backup.ino)):
        pass  # version 2: no record of the previous file but its backup's inode
    else:
        was = [str(entry.ino) + " (the new file)"] + ([f"{old.ino} (the previous file)"] if old else [])
        if backup is not None and old is None:
            was.append(f"{backup.ino} (its backup)")
        if not entry.had_target and old is None:
            was.append("no file")
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
    copied = journal.folder_id is not None and _folder_id(folder) != journal.folder_id
    problems = [p for e in journal.entries for p in _not_own(e)]
    if not problems:
        _check_kinds(journal)
        problems = [p for e in journal.entries for p in _problems(e, copied)]
    if problems:
        raise RecoveryError(
            f"journal {journal.path}: another program changed the set's files since the save was killed "
            f"({'; '.join(problems)}); refused: the journal and every file are left as they are, none "
            f"touched; check the files in {folder}, then remove the journal by hand")
