"""File primitives every stage uses: exact positional reads and input checks."""

from __future__ import annotations

import errno
import os
import stat
from typing import Iterable


def pread_exact(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at file ``offset`` (bytes), looping on short reads.

    Returns the bytes read: ``len(view)``, or fewer when the file ends first
    (callers turn that into their own error, naming file and offset).
    """
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def check_regular_inputs(paths: Iterable[str]) -> None:
    """Refuse, before opening anything, inputs that are not regular files: a
    folder, a FIFO (opening it would block) or a device (it may never end).
    Missing files pass: the command reports them after its own checks.

    Raises:
        IsADirectoryError: a folder.
        OSError: (EINVAL) a FIFO, socket or device, naming the path.
    """
    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", path)


def case_insensitive(folder: str) -> bool:
    """Whether ``folder``'s file system ignores case in names (vfat, exFAT,
    macOS defaults, casefolded ext4): a probe file
    ``.case-probe.ptdstream-<pid>-<hex>.tmp`` is created, looked up upper-cased,
    and removed (a killed probe's file is an ordinary stale temp file). A folder
    that is missing or not writable counts as case-sensitive."""
    import secrets

    name = f".case-probe.ptdstream-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    path = os.path.join(folder, name)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    os.close(fd)
    try:
        return os.path.exists(os.path.join(folder, name.upper()))
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
