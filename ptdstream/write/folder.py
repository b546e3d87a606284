"""The folder step of a save, and the file a write to a path replaces.

A save runs :func:`prepare_folder` once per folder before it creates its first
temp file there (a sink used on its own runs it itself; a set-level writer runs
:func:`ptdstream.write.publish.prepare_folders` once for all its folders).
"""

from __future__ import annotations

import errno
import os
import stat

from ..system import fsops
from . import journal

__all__ = ["prepare_folder", "resolve_target"]


#: fsync a folder so a rename in it is durable (ignored where unsupported).
fsync_dir = fsops.fsync_dir


def prepare_folder(folder: str) -> None:
    """The folder step a save runs once per folder before creating its temp
    files: complete the set publications killed saves left half done and remove
    dead writers' leftovers (:func:`ptdstream.write.journal.clean_folder`; live
    writers' files are never touched). A folder that does not exist is skipped
    (the temp file's creation reports it). A journal that cannot be completed
    is left for ``ptdstream recover`` (:class:`~ptdstream.write.journal.RecoveryError`
    is not raised): the files of this save are still published atomically."""
    if os.path.isdir(folder):
        try:
            journal.clean_folder(folder)
        except journal.RecoveryError:
            pass


#: Links followed before a chain counts as a loop (Linux's MAXSYMLINKS).
_MAX_LINKS = 40


def resolve_target(target: str) -> str:
    """The file a write to ``target`` replaces: ``target`` itself, or, when it is a
    symlink, the file the link points to (followed to the end, as ``open`` does).

    A link is followed only where the kernel's ``fs.protected_symlinks`` rule would
    let ``open`` follow it, whatever that setting is (``realpath`` follows links
    in user space, past the kernel's check): a link in a sticky world-writable
    folder (``/tmp``, mode 1777) that is owned neither by this process's
    effective uid nor by the folder's owner was planted there by another user.

    Raises:
        PermissionError: (EACCES) such a link, naming it, its owner and the folder.
        OSError: (ELOOP) a chain of more than 40 links.
    """
    if not os.path.islink(target):
        return target
    path = target
    for _ in range(_MAX_LINKS):
        if not os.path.islink(path):
            return os.path.realpath(path)
        _refuse_foreign_link(path)
        path = os.path.join(os.path.dirname(path), os.readlink(path))
    raise OSError(errno.ELOOP, f"cannot write {target}: more than {_MAX_LINKS} symbolic links", target)


def _refuse_foreign_link(link: str) -> None:
    """Raise PermissionError when the kernel's ``fs.protected_symlinks`` rule forbids following ``link``."""
    folder = os.path.dirname(os.path.abspath(link))
    st, dst = os.lstat(link), os.stat(folder)
    euid = os.geteuid()
    if not (dst.st_mode & stat.S_ISVTX and dst.st_mode & stat.S_IWOTH) or st.st_uid in (euid, dst.st_uid):
        return
    raise PermissionError(
        errno.EACCES,
        f"cannot write through {link}: a symbolic link owned by uid {st.st_uid} in the sticky, world-writable "
        f"folder {folder} (owned by uid {dst.st_uid}) is another user's, not followed (the kernel's "
        f"fs.protected_symlinks rule); remove it or choose another path",
        link,
    )
