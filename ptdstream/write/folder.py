"""The folder step of a save, and the file a write to a path replaces.

A save runs :func:`prepare_folder` once per folder before it creates its first
temp file there (a sink used on its own runs it itself; a set-level writer runs
:func:`ptdstream.write.publish.prepare_folders` once for all its folders).
"""

from __future__ import annotations

import os

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


def resolve_target(target: str) -> str:
    """The file a write to ``target`` replaces: ``target`` itself, or, when it is a
    symlink, the file the link points to (followed to the end, as ``open`` does)."""
    if os.path.islink(target):
        return os.path.realpath(target)
    return target
