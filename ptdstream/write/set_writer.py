"""Write a :class:`~ptdstream.format.plan.SavePlan`: every file to a temp file,
every temp file synced, then the set published as one.

On any error every temp file is removed and nothing is published; after a crash
the folder holds the whole old set or, once recovered, the whole new one (see
:mod:`ptdstream.write.journal`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..defaults import CHUNK_NBYTES, WINDOW_NBYTES
from ..format.plan import FileRole, SavePlan
from ..sources.base import BufferRing
from ..sources.fingerprint import Fingerprint
from .publish import folder_locks, prepare_folders, publish_set
from .sink import ChunkedFileSink
from .writer import write_plan

__all__ = ["FileReport", "write_save_plan"]


@dataclass(frozen=True)
class FileReport:
    """One written file: its path, role, size and payload (bytes streamed from
    sources) in bytes, and the xxh3-128 fingerprint of each payload section."""

    path: str
    role: FileRole
    nbytes: int
    payload_nbytes: int
    fingerprints: dict[str, Fingerprint]

    @property
    def kind(self) -> str:
        """``"pte"`` or ``"ptd"``."""
        return "pte" if self.role is FileRole.PROGRAM else "ptd"


def write_save_plan(
    plan: SavePlan,
    *,
    chunk_nbytes: int = CHUNK_NBYTES,
    window_nbytes: int = WINDOW_NBYTES,
    progress: Callable[[int], object] | None = None,
    sink_factory: Callable[[str], ChunkedFileSink] | None = None,
    direct: bool = False,
    extra_files: Callable[[list[ChunkedFileSink]], list[ChunkedFileSink]] | None = None,
    also_targets: Sequence[str] = (),
) -> list[FileReport]:
    """Write every file of ``plan`` to temp files, sync them all, then publish.

    Before the first temp file is created, each folder of the set gets the
    folder step once (:func:`ptdstream.write.publish.prepare_folders`); the
    sinks made here skip it. ``extra_files`` sinks go into those folders too
    (make them with ``clean_folder=False``).

    Args:
        plan: the set to write (data files first, the program last).
        chunk_nbytes: piece size in bytes for file sources' ring.
        window_nbytes: bytes between page-cache drops.
        progress: called with the bytes of each piece written.
        sink_factory: makes the sink of a target path (tests inject faults;
            ``clean_folder=False`` spares the folder a second step).
        direct: O_DIRECT writes instead of buffered writes with windowed
            writeback (:mod:`ptdstream.system.writeback`). Buffered is the
            default for every source, CUDA sources included.
        extra_files: called with the synced sinks before publishing; returns more
            synced sinks (a manifest of the set, read back from the temp files)
            that are published in the same set, after the plan's files (it must
            abort its own sinks if it fails).
        also_targets: the paths ``extra_files`` will publish (their folders
            prepared and checked with the plan's own, before anything is written).

    Returns:
        One :class:`FileReport` per file, in publish order.

    Raises:
        OverwriteError: a file to write is a checkpoint an open ``weights_from``
            reads (:func:`~ptdstream.write.open_inputs.refuse_open_checkpoints`;
            nothing written).
        IntegrityError: a source changed or vanished (nothing published).
        OSError: a write, fsync or rename failed (nothing published).
    """
    ring = BufferRing(chunk_nbytes, count=2)
    make = sink_factory or (
        lambda p: ChunkedFileSink(p, window_nbytes=window_nbytes, direct=direct, clean_folder=False)
    )
    sinks: list[ChunkedFileSink] = []
    reports: list[FileReport] = []
    prepare_folders([planned.path for planned in plan.files] + list(also_targets))  # refuses open checkpoints
    try:
        for planned in plan.files:
            sink = make(planned.path)
            sinks.append(sink)
            fps = write_plan(planned.plan, sink, ring, progress)
            sink.sync()
            reports.append(FileReport(sink.target, planned.role, planned.plan.nbytes,
                                      planned.plan.payload_nbytes(), fps))
        if extra_files is not None:
            sinks.extend(extra_files(list(sinks)))
        with folder_locks([os.path.dirname(s.publish_path) for s in sinks]):
            publish_set(sinks)
    except BaseException:
        for sink in sinks:
            sink.abort()
        raise
    return reports
