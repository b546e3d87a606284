"""A random mark in an extended attribute: what proves that ptdstream's writer made a file.

Every temp file ptdstream creates gets a fresh random mark (16 random bytes, as
32 hex digits) in the extended attribute :data:`MARK_ATTR`, set through its open
descriptor right after the file is created; the set's journal records each temp
file's mark. A file keeps its attributes when renamed, so a new file renamed
over its target still carries it. Recovery replaces or removes a file at a
target's name, or moves a temp file there, only when that file carries the mark
its journal recorded (:mod:`ptdstream.write.journal_state`).

Where the file system takes no extended attribute (``ENOTSUP``: FAT, tmpfs
before Linux 6.6, some network file systems; or a platform without
``os.setxattr``) the file has no mark and the journal records none: recovery
then leaves such files as they are and says so.
"""

from __future__ import annotations

import errno
import os
import re
import secrets

__all__ = ["MARK_ATTR", "MARK_RE", "put_mark", "read_mark", "why_unmarked"]

#: The extended attribute holding a temp file's mark.
MARK_ATTR = "user.ptdstream.mark"
#: A mark as the journal records it: 32 lowercase hex digits.
MARK_RE = re.compile(r"[0-9a-f]{32}")


def put_mark(fd: int) -> str | None:
    """Set a fresh random mark on the open file ``fd``; the mark (32 hex digits),
    or ``None`` where the file system takes no extended attribute (any
    ``OSError``: ``ENOTSUP``, ``EPERM``, ``ENOSPC``; the file is unchanged)."""
    setxattr = getattr(os, "setxattr", None)
    if setxattr is None:
        return None
    mark = secrets.token_hex(16)
    try:
        setxattr(fd, MARK_ATTR, mark.encode("ascii"))
    except OSError:
        return None
    return mark


def _get(path: str) -> bytes:
    getxattr = getattr(os, "getxattr", None)
    if getxattr is None:
        raise OSError(errno.ENOTSUP, "this platform has no extended attributes")
    value: bytes = getxattr(path, MARK_ATTR, follow_symlinks=False)
    return value


def read_mark(path: str) -> str | None:
    """The mark ``path`` carries (not following a link), or ``None`` (no mark, an
    unreadable one, no extended attributes)."""
    try:
        value = _get(path)
    except OSError:
        return None
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if MARK_RE.fullmatch(text) else None


def why_unmarked(path: str, mark: str | None) -> str | None:
    """``None`` when ``path`` carries ``mark``; else why it cannot be proven the
    writer's, as a phrase ("carries no ptdstream mark", ...)."""
    if mark is None:
        return "the journal recorded no mark (the file system took no extended attribute when the save ran)"
    try:
        value = _get(path)
    except OSError as e:
        if e.errno in (errno.ENODATA, getattr(errno, "ENOATTR", errno.ENODATA)):
            return "carries no ptdstream mark"
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return "its mark cannot be read: the file system has no extended attributes (ENOTSUP)"
        return f"its mark cannot be read ({type(e).__name__}: {e})"
    if value != mark.encode("ascii"):
        return "carries another mark than the journal's"
    return None
