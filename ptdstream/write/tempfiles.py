"""Temp files beside their target, and whether the writer of one is still alive.

Names: ``.<name>.ptdstream-<pid>-<8 hex>.<suffix>`` beside the target (same
folder, so a rename publishes atomically), the name cut and hashed when long.
Suffixes: ``tmp`` (data being written), ``bak`` (a hard link to the previous
file, kept while a set is published), ``journal`` (a set being published, see
:mod:`ptdstream.write.journal`).

Liveness is decided by a lock, not by the pid in the name: the writer of a
``.tmp`` file holds an exclusive ``flock`` on it from its creation until it is
published or removed (:func:`create_locked`). A ``.tmp`` file whose lock can be
taken has no writer (the kernel drops the lock of a killed process), whatever
PID namespace wrote it; one whose lock is held is never touched. ``.bak`` and
``.journal`` files only exist while their writer holds the folder's lock
(:func:`folder_lock`), so under that lock they are leftovers.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
from collections.abc import Iterator

from ..system import fsops, marks

__all__ = ["create_locked", "folder_lock", "lock_holders", "parse_name", "remove_if_unlocked", "stale_temp_files",
           "stem", "temp_files_in", "temp_name_for"]

#: Longest file-name stem kept in temp names; longer names are cut and hashed so
#: that ``.<stem>.ptdstream-<pid>-<hex>.<suffix>`` stays under NAME_MAX (255 bytes).
STEM_MAX = 160
#: Any character of a name, newline included (DOTALL), a pid of ASCII digits only.
_NAME_RE = re.compile(
    r"\.(?P<stem>.+)\.ptdstream-(?P<pid>[0-9]+)-[0-9a-f]{8}\.(?P<suffix>tmp|bak|journal)", re.DOTALL
)


def stem(name: str) -> str:
    """``name`` as it appears in temp names: itself, or cut and hashed when long."""
    if len(os.fsencode(name)) <= STEM_MAX:
        return name
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    cut = os.fsdecode(os.fsencode(name)[: STEM_MAX - 17])
    return f"{cut}~{digest}"


def temp_name_for(target: str, suffix: str = "tmp") -> str:
    """A fresh temp path beside ``target``: ``.<name>.ptdstream-<pid>-<8 hex>.<suffix>``."""
    folder, name = os.path.split(os.path.abspath(target))
    return os.path.join(
        folder, f".{stem(name)}.ptdstream-{os.getpid()}-{secrets.token_hex(4)}.{suffix}"
    )


def parse_name(name: str) -> tuple[str, str] | None:
    """``(stem, suffix)`` of a ptdstream temp file name, or ``None`` for any other name."""
    match = _NAME_RE.fullmatch(name)
    return (match.group("stem"), match.group("suffix")) if match else None


def pid_of(name: str) -> str | None:
    """The writer's pid (digits) in a ptdstream temp file name, or ``None`` for any other name."""
    match = _NAME_RE.fullmatch(name)
    return match.group("pid") if match else None


def create_locked(target: str, suffix: str = "tmp", mode: int = 0o666) -> tuple[str, int, int]:
    """Create a fresh temp file for ``target`` and lock it; ``(path, fd, lock_fd)``.

    ``fd`` is open for writing; ``lock_fd`` (a duplicate of it) holds the
    exclusive ``flock`` that marks the file live: keep it open until the file is
    renamed or removed, then close it (closing ``fd`` alone keeps the lock). A
    ``tmp`` file carries a fresh random mark (:func:`ptdstream.system.marks.put_mark`;
    none where the file system takes no extended attribute), which its journal
    records and recovery checks before it moves or removes the file.

    A cleaner may take the lock of a file just created, before its writer does,
    and remove it; the writer then sees that its path no longer names its file
    and starts again under a new name. It never waits for that lock: another user
    who can read the folder may take it and keep it for good, so a lock it cannot
    take at once makes it remove the file and start again under a new name.

    Raises:
        OSError: the file cannot be created (the message names target and folder).
    """
    folder = os.path.dirname(os.path.abspath(target))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        path = temp_name_for(target, suffix)
        try:
            fd = os.open(path, flags, mode)
        except OSError as e:
            raise OSError(
                e.errno,
                f"cannot create a temp file for {target} in folder {folder} "
                f"({os.strerror(e.errno or 0)}); the folder must exist and be writable",
                path,
            ) from e
        lock_fd = None
        try:
            lock_fd = os.dup(fd)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a cleaner took it first, or another user who may keep it for good
                if _names(path, lock_fd):
                    fsops.unlink(path)
            else:
                if _names(path, lock_fd):
                    if suffix == "tmp":
                        marks.put_mark(fd)
                    return path, fd, lock_fd
        except BaseException:  # Ctrl-C included: leave no file behind
            if lock_fd is not None and _names(path, lock_fd):
                fsops.unlink(path)
            for open_fd in (lock_fd, fd):
                if open_fd is not None:
                    os.close(open_fd)
            raise
        os.close(lock_fd)
        os.close(fd)
    raise OSError(errno.EAGAIN, f"cannot keep a temp file for {target} in folder {folder}")


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def remove_if_unlocked(path: str) -> bool:
    """Remove the ``.tmp`` file ``path`` if no writer holds its lock; returns whether
    it was removed. A file that cannot be opened to test its lock is kept."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a live writer holds it
        from .open_inputs import is_open_checkpoint

        if not _names(path, fd) or is_open_checkpoint(path):
            return False  # replaced meanwhile, or a checkpoint weights_from reads that only looks like one
        return fsops.unlink(path)
    finally:
        os.close(fd)


def is_locked(path: str) -> bool:
    """Whether a live writer holds the lock of the temp file ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


@contextlib.contextmanager
def folder_lock(folders: list[str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on each folder (sorted, so two holders never
    deadlock) for the ``with`` block. No lock file is left behind: the lock is on
    the folder itself. A folder that cannot be opened is not locked."""
    fds = []
    try:
        for folder in sorted(set(os.path.abspath(f or ".") for f in folders)):
            try:
                fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                continue
            fds.append(fd)
            _lock_waiting_only_for_this_user(fd, folder)
        yield
    finally:
        for fd in reversed(fds):
            os.close(fd)


def lock_holders(fd: int) -> list[tuple[int, int | None]]:
    """The ``(pid, uid)`` of each process the kernel lists (``/proc/locks``) as
    holding a ``flock`` on the file open at ``fd``; the uid is None where that
    process's ``/proc`` entry cannot be read. Empty where ``/proc/locks`` cannot be read."""
    st = os.fstat(fd)
    here = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holders = []
    try:
        with open("/proc/locks") as f:
            lines = f.read(1 << 24).splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->" or fields[1] != "FLOCK" or fields[5] != here:
            continue
        pid = int(fields[4])
        try:
            uid: int | None = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            uid = None
        holders.append((pid, uid))
    return holders


def _lock_waiting_only_for_this_user(fd: int, folder: str) -> None:
    """Take ``folder``'s exclusive ``flock`` (open at ``fd``). Waits while processes
    of this user (or of an unknown uid) hold it: saves of the same user into the
    same folder take turns. A holder of another uid is not waited for, since any
    user who can read a folder can lock it for ever.

    Raises:
        BlockingIOError: another user's process holds the lock (names the folder,
            the pid and the uid).
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    others = [(pid, uid) for pid, uid in lock_holders(fd) if uid is not None and uid != os.geteuid()]
    if others:
        named = ", ".join(f"pid {pid} (uid {uid})" for pid, uid in others)
        raise BlockingIOError(errno.EWOULDBLOCK,
                              f"{folder} is locked by another user's process, {named}: ptdstream waits only "
                              "for its own user's saves into a folder; try again once it has ended, or save "
                              "into a folder only you can write", folder)
    fcntl.flock(fd, fcntl.LOCK_EX)


@contextlib.contextmanager
def folder_lock_nowait(folder: str) -> Iterator[bool]:
    """Try to take ``folder``'s lock (:func:`folder_lock`) without waiting; yields
    whether it was taken (``False`` also when this process holds it already through
    another descriptor, or the folder cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def temp_files_in(folder: str) -> list[tuple[str, str, str]]:
    """``[(path, stem, suffix)]`` of every ptdstream temp file in ``folder``, sorted."""
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return []
    out = []
    for name in sorted(names):
        parsed = parse_name(name)
        if parsed is not None:
            out.append((os.path.join(folder, name), parsed[0], parsed[1]))
    return out


def stale_temp_files(target: str) -> list[str]:
    """Leftovers of dead writers for ``target``: its ``.tmp`` files whose lock is
    free and, when no publication holds the folder's lock, its ``.bak`` and
    ``.journal`` files (a journal is completed, not just removed:
    :func:`ptdstream.write.journal.recover`). Reads only."""
    folder, name = os.path.split(os.path.abspath(target))
    own = [(p, s) for p, st, s in temp_files_in(folder) if st == stem(name)]
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return []
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            publishing = False
        except OSError:
            publishing = True
        return [
            p for p, s in own
            if (s == "tmp" and not is_locked(p)) or (s != "tmp" and not publishing)
        ]
    finally:
        os.close(fd)
