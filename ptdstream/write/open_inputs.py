"""The files no writer may replace or remove: the checkpoints an open ``weights_from`` reads.

A save inside a ``weights_from`` block streams bound tensors from the
checkpoint's files (:func:`~ptdstream.sources.mapped.expecting_files` registers
them, by device and inode). Publishing over one of them, by any spelling (the
same name, a symlink, a hard link, a renamed file), would replace the user's
checkpoint: the save itself would still read the old inode, but the checkpoint
would be gone. Every sink (:class:`~ptdstream.write.sink.ChunkedFileSink`) and
every folder step (:func:`~ptdstream.write.publish.prepare_folders`) refuses
such a target first, and the folder step never removes such a file as a stale
temp file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..errors import OverwriteError
from ..sources.mapped import expected_files

__all__ = ["is_open_checkpoint", "refuse_open_checkpoints"]


def _open_checkpoint_of(path: str, held: dict[tuple[int, int], str]) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return held.get((st.st_dev, st.st_ino))


def is_open_checkpoint(path: str) -> bool:
    """Whether ``path`` (after symlinks) is a file an open ``weights_from`` reads."""
    held = expected_files()
    return bool(held) and _open_checkpoint_of(path, held) is not None


def refuse_open_checkpoints(targets: Iterable[str | None]) -> None:
    """Refuse a target (None: skipped) that is a checkpoint an open ``weights_from``
    reads, before anything is written.

    Raises:
        OverwriteError: naming the target and the checkpoint.
    """
    held = expected_files()
    if not held:
        return
    for target in targets:
        if target is None:
            continue
        checkpoint = _open_checkpoint_of(os.fspath(target), held)
        if checkpoint is not None:
            spelled = "" if os.path.abspath(target) == checkpoint else f" ({checkpoint})"
            raise OverwriteError(
                f"output {target} is a checkpoint file an open weights_from reads{spelled}: writing it would "
                "destroy the checkpoint; choose another output path")
