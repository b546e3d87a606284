"""Sets as a killed save leaves them, for the journal and recovery tests."""

from __future__ import annotations

import os

from ptdstream.write import journal, tempfiles


def killed_set(paths, renamed: int = 1) -> tuple[list[str], list[journal.JournalEntry]]:
    """What a save of ``paths`` killed after its first ``renamed`` renames leaves:
    each path held ``b"old " + name``; a dead writer's temp file ``b"new " + name``
    (made by ptdstream's own ``create_locked``, its mark included), a backup of each,
    the journals (one per folder, written by ptdstream's writer); returns
    ``(journals, entries)``."""
    entries = []
    for p in map(str, paths):
        name = os.path.basename(p).encode()
        with open(p, "wb") as f:
            f.write(b"old " + name)
        temp, fd, lock_fd = tempfiles.create_locked(p)
        os.write(fd, b"new " + name)
        os.close(fd)
        os.close(lock_fd)  # the writer is gone: its lock with it
        backup = tempfiles.temp_name_for(p, "bak")
        os.link(p, backup)
        st = os.lstat(temp)
        entries.append(journal.JournalEntry(p, temp, backup, True, st.st_dev, st.st_ino))
    groups: dict[str, list[journal.JournalEntry]] = {}
    for e in entries:
        groups.setdefault(os.path.dirname(e.target), []).append(e)
    journals: list[str] = []
    journal._write_journals(list(groups.values()), journals)
    for e in entries[:renamed]:
        os.replace(e.temp, e.target)
    return journals, entries
