"""Writing a set's journals: the files' states recorded, one journal per folder.

:func:`write_journals` writes one journal per folder of a set
(:mod:`ptdstream.write.journal_codec` gives the format): for a set in one folder,
one journal; across folders, a member journal in each folder but the last, then
the main journal in the last folder, whose name the members give, written last
(the set's commit point, :mod:`ptdstream.write.journal_peers`). Each records
every temp file's state and mark (:mod:`ptdstream.system.marks`) and is written,
mode 0600, to a locked temp file, fsynced, renamed into place, and its folder fsynced; on an
error the journal being written is removed (those already written are the
caller's to remove).
"""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Sequence

from ..system import fsops, marks
from . import tempfiles
from .journal_codec import JournalEntry, Ref, dump_journal, state_of

__all__ = ["write_journal", "write_journals"]


def _recorded(entry: JournalEntry) -> JournalEntry:
    """``entry`` with the states of its temp file and previous target and the
    temp file's mark, taken now (after the backup link) where not recorded yet."""
    if entry.new is not None:
        return entry
    new = state_of(entry.temp)
    if new is None or (new.dev, new.ino) != (entry.dev, entry.ino):
        raise FileNotFoundError(errno.ENOENT, f"the temp file {entry.temp} of {entry.target} is no longer the "
                                              f"one written (device/inode {entry.dev}/{entry.ino})", entry.temp)
    old = state_of(entry.target) if entry.had_target else None
    return dataclasses.replace(entry, new=new, old=old, mark=marks.read_mark(entry.temp))


def write_journal(path_for: str, entries: Sequence[JournalEntry], *, main: Ref | None = None,
                   members: Sequence[Ref] = (), reserved: tuple[str, int, int] | None = None) -> str:
    """Write, fsync and rename a journal of ``entries`` (all in ``path_for``'s
    folder) into place beside ``path_for``; its path. ``main``/``members``: the
    references of a set across folders; ``reserved``: the temp file
    (:func:`tempfiles.create_locked`) to write it through, whose name was given out."""
    folder = os.path.dirname(os.path.abspath(path_for))
    st = os.stat(folder)
    data = dump_journal([_recorded(e) for e in entries], (st.st_dev, st.st_ino), folder=folder,
                        main=main, members=members)
    temp, fd, lock_fd = reserved or tempfiles.create_locked(path_for, "tmp", 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            fsops.fsync(fd, temp)
        finally:
            os.close(fd)
        final = temp[: -len(".tmp")] + ".journal"
        fsops.replace(temp, final)
    except BaseException:
        fsops.unlink(temp)
        raise
    finally:
        os.close(lock_fd)
    fsops.fsync_dir(os.path.dirname(final))
    return final


def write_journals(groups: Sequence[Sequence[JournalEntry]], journals: list[str]) -> None:
    """One journal per folder into ``journals``: the members first, the main one last."""
    if len(groups) == 1:
        journals.append(write_journal(groups[0][-1].target, groups[0]))
        return
    reserved = tempfiles.create_locked(groups[-1][-1].target, "tmp", 0o600)
    try:
        main_path = reserved[0][: -len(".tmp")] + ".journal"
        main = (main_path, _folder_id(main_path))
        for group in groups[:-1]:
            journals.append(write_journal(group[-1].target, group, main=main))
        members = [(path, _folder_id(path)) for path in journals]
    except BaseException:
        fsops.unlink(reserved[0])
        os.close(reserved[1])
        os.close(reserved[2])
        raise
    journals.append(write_journal(groups[-1][-1].target, groups[-1], members=members, reserved=reserved))


def _folder_id(path: str) -> tuple[int, int]:
    st = os.stat(os.path.dirname(path))
    return st.st_dev, st.st_ino
