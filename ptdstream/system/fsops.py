"""The file-system operations that publish files, behind one hook.

Every rename, hard link, unlink and fsync that decides what a folder holds after
a crash goes through these functions, so a test can stop the process at each of
them in turn (:func:`set_hook`): the in-process equivalent of
``strace -e inject=rename:signal=SIGKILL:when=N``, needing nothing installed.

Not for data writes: those stay in the sinks (their own ``write_fn`` hook).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

__all__ = ["fsync", "fsync_dir", "link", "replace", "set_hook", "unlink"]

#: ``hook(op, path)`` called before each operation; ``op`` is ``"rename"``,
#: ``"link"``, ``"unlink"``, ``"fsync"`` or ``"fsync_dir"``; ``path`` the path the
#: operation changes (the destination of a rename or link).
Hook = Callable[[str, str], None]

_hook: Hook | None = None
_lock = threading.Lock()


def set_hook(hook: Hook | None) -> Hook | None:
    """Install ``hook`` (``None`` removes it); returns the previous one. Process-wide."""
    global _hook
    with _lock:
        previous, _hook = _hook, hook
    return previous


def _before(op: str, path: str) -> None:
    hook = _hook
    if hook is not None:
        hook(op, os.fsdecode(path))


def replace(src: str, dst: str) -> None:
    """``os.replace(src, dst)``: atomic within one file system."""
    _before("rename", dst)
    os.replace(src, dst)


def link(src: str, dst: str) -> None:
    """A hard link ``dst`` to ``src`` (never following a symlink ``src``)."""
    _before("link", dst)
    os.link(src, dst, follow_symlinks=False)


def unlink(path: str, *, missing_ok: bool = True) -> bool:
    """Remove ``path``; returns whether it existed. ``FileNotFoundError`` only when
    ``missing_ok`` is false."""
    _before("unlink", path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise
        return False
    return True


def fsync(fd: int, path: str = "") -> None:
    """``os.fsync(fd)``; ``path`` only names the file for the hook."""
    _before("fsync", path)
    os.fsync(fd)


def fsync_dir(folder: str) -> None:
    """fsync a folder so the renames, links and unlinks in it are durable
    (ignored where the file system does not support it)."""
    _before("fsync_dir", folder or ".")
    try:
        fd = os.open(folder or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
