"""``save(manager, path)``: the drop-in for ``write_to_file`` + ``write_tensor_data_to_file``,
and ``write_data_files(store, folder)`` for exporters that build their own store.

:func:`save` plans every file from the manager's program, mutable data, named
data and external constants (:mod:`ptdstream.manager`, the mirror of upstream's
``serialize_for_executorch``), writes them all to temp files, syncs them, then
publishes the set (:mod:`ptdstream.write.set_writer`): the .ptd files first, the
.pte last, no file unless all were written in full. It never replays the
manager's already-serialized output; that output is only what
:mod:`ptdstream.check.compare` compares with.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .defaults import CHUNK_NBYTES, WINDOW_NBYTES
from .reports import Report, rate

if TYPE_CHECKING:  # pragma: no cover
    from .format.pte import PteOptions
    from .store import StreamingNamedDataStore
    from .write.set_writer import FileReport

# The planning and writing stages are imported when a save runs, not with this
# module: ``import ptdstream`` (and every CLI command) stays fast.

__all__ = ["DataFilesReport", "SaveReport", "save", "write_data_files"]


@dataclass(frozen=True)
class SaveReport(Report):
    """What ``save`` did.

    Attributes:
        files: the files written, .ptd files first, in publish order.
        nbytes: bytes written in all.
        seconds: wall time from plan to the last publish.
        gbps: ``nbytes / seconds / 1e9`` (GB/s); the summary prints the rate of the
            write alone (``seconds - plan_seconds``), and only from
            :data:`~ptdstream.reports.RATE_MIN_NBYTES` (64 MiB) on.
        dedup_saved_nbytes: bytes not written because equal data was already
            stored under another key.
        plan_seconds: the part of ``seconds`` spent planning.
        options: the layout parameters used.
        manifest_path: the manifest written with ``manifest=True``, else None.
    """

    files: tuple[FileReport, ...]
    nbytes: int
    seconds: float
    gbps: float
    dedup_saved_nbytes: int
    plan_seconds: float
    options: PteOptions
    manifest_path: str | None = None

    def summary(self) -> str:
        lines = [f"{f.path}  {f.nbytes:,} bytes" for f in self.files]
        speed = rate(self.nbytes, self.seconds - self.plan_seconds)
        lines.append(
            f"{self.nbytes:,} bytes in {self.seconds:.2f} s (planning {self.plan_seconds:.2f} s, then the write, "
            f"fsync and publish{': ' + speed if speed else ''}); dedup saved {self.dedup_saved_nbytes:,} bytes"
        )
        return "\n".join(lines)


@dataclass(frozen=True)
class DataFilesReport(SaveReport):
    """What ``write_data_files`` did: a :class:`SaveReport` of the .ptd files
    (``manifest_path`` is None, ``options`` holds the segment alignment used).

    Iterating it, ``len()`` and indexing give ``files`` (the list of
    ``FileReport`` that ``write_data_files`` returned before it returned a report).
    """

    def __iter__(self):
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index):
        return self.files[index]


def save(
    manager,
    path: str,
    *,
    config: Any = None,
    data_dir: str | None = None,
    chunk_nbytes: int = CHUNK_NBYTES,
    window_nbytes: int = WINDOW_NBYTES,
    progress: Any = False,
    manifest: bool = False,
    direct: bool = False,
) -> SaveReport:
    """Save ``manager`` as ``path`` (.pte) and every ``<tag>.ptd`` beside it.

    Byte-identical to ``manager.write_to_file`` + ``manager.write_tensor_data_to_file``
    for the same manager. Host memory added: about ``2 * chunk_nbytes`` plus
    metadata, whatever the model size; written pages are dropped from the page
    cache every ``window_nbytes``.

    Args:
        manager: an ``ExecutorchProgramManager`` (``to_executorch()``'s result).
        path: the .pte path (must end with ``.pte``).
        config: the ``ExecutorchBackendConfig`` it was built with, if known
            (otherwise recorded or read back: :mod:`ptdstream.manager.options`).
        data_dir: folder of the .ptd files (default: the .pte's folder).
        chunk_nbytes: piece size in bytes (8 MiB).
        window_nbytes: bytes between page-cache drops (64 MiB).
        progress: ``True`` for a tqdm bar on stderr, a callable taking the bytes
            of each piece, or ``False`` / ``None`` (:mod:`ptdstream.progress`).
        direct: write with O_DIRECT (no page cache; falls back to buffered
            writes where the file system refuses it). Default: buffered writes,
            each window sent to disk by a writeback thread and dropped from the
            page cache once written, for every source (CUDA sources included).
        manifest: also write ``<stem>.manifest`` beside the .pte
            (:mod:`ptdstream.manifest.describe`): piece digests, sections and key
            fingerprints of every file written, read back from disk once.

    Returns:
        A :class:`SaveReport` (files, bytes, seconds, GB/s, dedup savings).

    Raises:
        ValueError, LayoutError: bad path, tag or parameters (nothing written).
        ArgumentTypeError: a ``progress`` outside the contract (nothing written).
        OverwriteError: a file to write (the .pte, a .ptd, the manifest) is a
            checkpoint an open ``weights_from`` reads (nothing written).
        IntegrityError: a source changed or vanished (nothing published).
        OSError: a write, fsync or rename failed (nothing published).
    """
    from .manager import plan_manager
    from .progress import check_progress

    check_progress(progress)
    start = time.perf_counter()
    plan = plan_manager(manager, path, config=config, data_dir=data_dir)
    plan_seconds = time.perf_counter() - start
    manifest_path = None
    extra_files = None
    if manifest:
        from .manifest.describe import manifest_path_for, manifest_sink  # flatbuffers + numpy: only when asked

        manifest_path = manifest_path_for(path)

        def extra_files(sinks):  # published in the same set as the files it describes
            described = [(s.temp_path, os.path.basename(s.target)) for s in sinks]
            return [manifest_sink(described, manifest_path)]

    return _write_and_report(SaveReport, plan, start, plan_seconds, progress,
                             f"saving {len(plan.files)} file(s) of {os.path.basename(path)}",
                             chunk_nbytes=chunk_nbytes, window_nbytes=window_nbytes, direct=direct,
                             extra_files=extra_files, also_targets=[manifest_path] if manifest_path else [],
                             manifest_path=manifest_path)


def write_data_files(
    store: StreamingNamedDataStore,
    folder: str,
    *,
    segment_alignment: int = 128,
    chunk_nbytes: int = CHUNK_NBYTES,
    window_nbytes: int = WINDOW_NBYTES,
    progress: Any = False,
    direct: bool = False,
) -> DataFilesReport:
    """Write each external tag of ``store`` as ``folder/<tag>.ptd`` (embedding API).

    For exporters that build a :class:`StreamingNamedDataStore` themselves: the
    files equal what ``FlatTensorSerializer`` gives for the same store. All files
    are synced before any is published; on error none is. ``folder`` must exist.

    Args:
        store: the named data; only its external tags are written.
        folder: the existing folder of the .ptd files.
        segment_alignment: bytes (the ``FlatTensorSerializer``'s, 128).
        chunk_nbytes, window_nbytes, direct: as :func:`save`.
        progress: as :func:`save`: ``True`` for a tqdm bar on stderr, a callable
            taking the bytes of each piece, or ``False`` / ``None``.

    Returns:
        A :class:`DataFilesReport` (files, bytes, seconds, GB/s, dedup savings;
        ``summary()``, ``to_json()``).

    Raises:
        LayoutError: a tag that would leave ``folder``.
        ArgumentTypeError: a ``progress`` outside the contract (nothing written).
        OverwriteError, IntegrityError, OSError: as :func:`save` (nothing published).
    """
    from .format.plan import SavePlan
    from .format.ptd import plan_data_files
    from .format.pte import PteOptions
    from .progress import check_progress

    check_progress(progress)
    start = time.perf_counter()
    out = store.get_named_data_store_output()
    files = plan_data_files(out.buffers, out.external_data, folder,
                            segment_alignment=segment_alignment, fingerprints=out.fingerprints)
    plan = SavePlan(files, None, PteOptions(segment_alignment=segment_alignment), store.dedup_saved_nbytes)
    plan_seconds = time.perf_counter() - start
    return _write_and_report(DataFilesReport, plan, start, plan_seconds, progress,
                             f"writing {len(plan.files)} .ptd file(s)",
                             chunk_nbytes=chunk_nbytes, window_nbytes=window_nbytes, direct=direct)


def _write_and_report(report_type, plan, start, plan_seconds, progress, description, *, chunk_nbytes,
                      window_nbytes, direct, extra_files=None, also_targets=(), **fields):
    """Write ``plan`` (progress as :func:`progress_callback` takes it, ``description``
    on its bar) and return ``report_type`` (a :class:`SaveReport`) of it, timed from
    ``start`` (``time.perf_counter()``); ``fields``: the report's extra fields."""
    from .progress import progress_callback
    from .write.set_writer import write_save_plan

    with contextlib.ExitStack() as stack:
        callback = progress_callback(stack, progress, plan.nbytes, description)
        reports = write_save_plan(plan, chunk_nbytes=chunk_nbytes, window_nbytes=window_nbytes,
                                  progress=callback, direct=direct, extra_files=extra_files,
                                  also_targets=also_targets)
    seconds = time.perf_counter() - start
    nbytes = sum(r.nbytes for r in reports)
    return report_type(files=tuple(reports), nbytes=nbytes, seconds=seconds,
                       gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
                       dedup_saved_nbytes=plan.dedup_saved_nbytes, plan_seconds=plan_seconds,
                       options=plan.options, **fields)
