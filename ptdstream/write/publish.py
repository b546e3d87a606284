"""Publishing a set of synced temp files: all or none, one set at a time per folder.

Used by :func:`ptdstream.write.set_writer.write_save_plan`.
"""

from __future__ import annotations

import contextlib
import os
from typing import List, Optional, Tuple

from .sink import ChunkedFileSink
from .tempfiles import stale_temp_files, temp_name_for


@contextlib.contextmanager
def folder_locks(folders: List[str]):
    """Hold an exclusive ``flock`` on each folder while a set of files is published.

    Two ptdstream saves into one folder then publish their sets one after the
    other, never interleaved (a .pte of one save beside a .ptd of the other). The
    lock is on the folder itself: no lock file is left behind.
    """
    import fcntl

    fds = []
    try:
        for folder in folders:
            fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        for fd in reversed(fds):
            os.close(fd)


def publish_set(sinks: List[ChunkedFileSink]) -> None:
    """Rename every synced temp file over its target, all or none.

    Each existing target is first hard-linked to a backup name; if a rename
    fails, the files already renamed are put back (or removed, where there was
    none) before the error is raised, so the previous set stays whole. The
    backups are removed once every file is published. A process killed between
    two renames can still leave a mixed set (see README, Known limits); its
    backups are recognisable and removed by the next save.
    """
    backups: List[Tuple[str, Optional[str]]] = []
    done: List[Tuple[str, Optional[str]]] = []
    try:
        for sink in sinks:
            backup = None
            if os.path.isfile(sink.target) and not os.path.islink(sink.target):
                backup = temp_name_for(sink.target, "bak")
                try:
                    os.link(sink.target, backup, follow_symlinks=False)
                except OSError:
                    backup = None  # no hard links here: publish without a way back
            backups.append((sink.target, backup))
        for sink, entry in zip(sinks, backups):
            sink.publish()
            done.append(entry)
    except BaseException:
        for target, backup in reversed(done):
            try:
                if backup is not None:
                    os.replace(backup, target)
                else:
                    os.unlink(target)
            except OSError:
                pass
        raise
    finally:
        for _, backup in backups:
            if backup is not None:
                try:
                    os.unlink(backup)
                except FileNotFoundError:
                    pass


def remove_stale_temp_files(target: str) -> List[str]:
    """Remove temp files of ``target`` left by killed processes; returns their paths.

    Only ``.<name>.ptdstream-<pid>-<hex>.tmp`` files whose pid no longer runs are
    touched; a save in progress in another process keeps its temp file.
    """
    removed = []
    for path in stale_temp_files(target):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
