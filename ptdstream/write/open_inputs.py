"""The files no writer may replace or remove: the checkpoints an open ``weights_from`` reads.

A save inside a ``weights_from`` block streams bound tensors from the
checkpoint's files (:func:`~ptdstream.sources.mapped.expecting_files` registers
them, by device and inode). Publishing over one of them, by any spelling (the
same name, a symlink, a hard link, a renamed file), would replace the user's
checkpoint: the save itself would still read the old inode, but the checkpoint
would be gone. Every sink (:class:`~ptdstream.write.sink.ChunkedFileSink`) and
every folder step (:func:`~ptdstream.write.publish.prepare_folders`) refuses
such a target first, and the folder step never removes such a file as a stale
temp file. Both also refuse to start while such a checkpoint has been written to
in place since it was opened: the save would publish values read before the
change (quantized weights, converted copies) over an existing output, and the
change would be reported only when the block exits.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..errors import IntegrityError, OverwriteError
from ..sources.mapped import changed_in_place, expected_files

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
    reads, and any save while such a checkpoint has been written to in place since
    it was opened, before anything is written.

    Raises:
        IntegrityError: naming the changed checkpoint file and both identities.
        OverwriteError: naming the target and the checkpoint.
    """
    held = expected_files()
    if not held:
        return
    changed = changed_in_place()
    if changed:
        path, then, now = changed[0]
        raise IntegrityError(
            f"checkpoint file {path}: written to after an open weights_from opened it (device, inode, size, "
            f"modification and change time {tuple(then)} then, {tuple(now)} now)"
            + (f" (and {len(changed) - 1} more: {', '.join(p for p, _, _ in changed[1:4])})" if len(changed) > 1
               else "")
            + "; nothing is written: the export holds values read before the change; a checkpoint must not "
            "change until the save: export again from an unchanged checkpoint")
    for target in targets:
        if target is None:
            continue
        checkpoint = _open_checkpoint_of(os.fspath(target), held)
        if checkpoint is not None:
            spelled = "" if os.path.abspath(target) == checkpoint else f" ({checkpoint})"
            raise OverwriteError(
                f"output {target} is a checkpoint file an open weights_from reads{spelled}: writing it would "
                "destroy the checkpoint; choose another output path")
