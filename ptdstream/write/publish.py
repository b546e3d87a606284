"""Publishing a set of synced temp files: all or none, one set at a time per folder.

Used by :func:`ptdstream.write.set_writer.write_save_plan`; the mechanism is
:mod:`ptdstream.write.journal` (crash-consistent: a journal completed by the next
writer into the folder, or by :func:`ptdstream.write.journal.recover`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from . import journal, tempfiles
from .folder import prepare_folder, resolve_target
from .open_inputs import refuse_open_checkpoints
from .sink import ChunkedFileSink

__all__ = ["folder_locks", "publish_set", "remove_stale_temp_files"]

#: Exclusive ``flock`` on each folder while a set is published (sorted, no lock file).
folder_locks = tempfiles.folder_lock


def publish_set(sinks: list[ChunkedFileSink]) -> None:
    """Publish every synced sink as one set, in order; the caller holds
    :func:`folder_locks` on every target folder.

    After a crash at any instant the folder holds the whole previous set or, once
    recovered, the whole new one; a failed rename puts the previous set back
    before the error is raised.

    Raises:
        OSError: a link, rename or fsync failed (the previous set is back, or the
            journal stays for ``recover``).
    """
    # Under the locks just taken: a set that a save killed since this one's
    # folder step left half done is completed before this set replaces its files.
    for folder in _folders(s.publish_path for s in sinks):
        journal.recover_locked(folder, targets=[s.publish_path for s in sinks])
    journal.publish(
        [(s.temp_path, s.publish_path) for s in sinks], renames=[s.publish for s in sinks]
    )


def _folders(paths: Iterable[str]) -> list[str]:
    """The distinct folders of ``paths``, in first-seen order."""
    return list(dict.fromkeys(os.path.dirname(os.path.abspath(p)) for p in paths))


def prepare_folders(targets: Iterable[str]) -> list[str]:
    """The folder step of a save, once per folder, before any temp file is
    created: :func:`ptdstream.write.folder.prepare_folder` for the folder of
    each file a target's publication renames over (a symlink's target's folder).
    Then make the sinks with ``ChunkedFileSink(..., clean_folder=False)``.
    Returns the folders, in first-seen order.

    Raises:
        OverwriteError: a target is a checkpoint an open ``weights_from`` reads
            (:func:`~ptdstream.write.open_inputs.refuse_open_checkpoints`), before
            any folder step.
        IntegrityError: such a checkpoint was written to in place since it was
            opened (the same check), before any folder step."""
    targets = [os.fspath(t) for t in targets]
    refuse_open_checkpoints(targets)
    folders = _folders(resolve_target(os.path.abspath(t)) for t in targets)
    for folder in folders:
        prepare_folder(folder)
    return folders


def remove_stale_temp_files(target: str) -> list[str]:
    """Remove the leftovers of killed writers in ``target``'s folder (and complete
    their pending set publications); returns the journals completed.

    Leftovers are found by lock, not pid: a save in progress in another process,
    in any PID namespace, keeps its temp file.
    """
    return [j for j, _ in journal.clean_folder(os.path.dirname(os.path.abspath(target)))]
