"""Publishing a set of synced temp files: all or none, one set at a time per folder.

Used by :func:`ptdstream.write.set_writer.write_save_plan`; the mechanism is
:mod:`ptdstream.write.journal` (crash-consistent: a journal completed by the next
writer into the folder, or by :func:`ptdstream.write.journal.recover`).
"""

from __future__ import annotations

import os
from typing import List

from .sink import ChunkedFileSink
from . import journal, tempfiles

__all__ = ["folder_locks", "publish_set", "remove_stale_temp_files"]

#: Exclusive ``flock`` on each folder while a set is published (sorted, no lock file).
folder_locks = tempfiles.folder_lock


def publish_set(sinks: List[ChunkedFileSink]) -> None:
    """Publish every synced sink as one set, in order; the caller holds
    :func:`folder_locks` on every target folder.

    After a crash at any instant the folder holds the whole previous set or, once
    recovered, the whole new one; a failed rename puts the previous set back
    before the error is raised.

    Raises:
        OSError: a link, rename or fsync failed (the previous set is back, or the
            journal stays for ``recover``).
    """
    for sink in sinks:
        journal.recover_locked(os.path.dirname(sink.publish_path), targets=[s.publish_path for s in sinks])
    journal.publish(
        [(s.temp_path, s.publish_path) for s in sinks], renames=[s.publish for s in sinks]
    )


def remove_stale_temp_files(target: str) -> List[str]:
    """Remove the leftovers of killed writers in ``target``'s folder (and complete
    their pending set publications); returns the journals completed.

    Leftovers are found by lock, not pid: a save in progress in another process,
    in any PID namespace, keeps its temp file.
    """
    return [j for j, _ in journal.clean_folder(os.path.dirname(os.path.abspath(target)))]
