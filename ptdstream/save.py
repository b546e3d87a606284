"""``save(manager, path)``: the drop-in for ``write_to_file`` + ``write_tensor_data_to_file``.

It plans and writes through ptdstream's own store, planners and writer, from the
manager's program, mutable data, named data and external constants, following
``exir/_serialize/_serialize.py::serialize_for_executorch`` (executorch 1.5.1):

* the .pte holds the backends' ``pte_data`` named data when there is any;
* with no emitter external constants, each tag of the backends' store becomes
  ``<tag>.ptd`` as it is;
* otherwise a fresh store takes the emitter's constants first (alignment 1,
  layouts from the program), then merges the backends' store, and each of its
  tags becomes a .ptd (a tag whose keys were all already present elsewhere
  still gets its, empty, file: upstream does the same).

It never replays the manager's already-serialized output; that output is only
what :mod:`ptdstream.verify` compares with. All files are written to temp files
and synced first; then the .ptd files are published, then the .pte: no file
appears unless all were written in full.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _upstream
from .errors import LayoutError
from .fingerprint import Fingerprint
from .plan import FilePlan
from .pte import PteOptions, plan_pte
from .ptd import plan_ptd
from .publish import folder_locks, publish_set, remove_stale_temp_files
from .sink import DEFAULT_WINDOW_NBYTES, ChunkedFileSink
from .sources import DEFAULT_CHUNK_NBYTES, BufferRing, Source, as_source
from .store import StreamingNamedDataStore
from .writer import write_plan


@dataclass(frozen=True)
class FileReport:
    """One written file: its path, kind ("pte"/"ptd"), size and payload in bytes."""

    path: str
    kind: str
    nbytes: int
    payload_nbytes: int
    fingerprints: Dict[str, Fingerprint]


@dataclass(frozen=True)
class SaveReport:
    """What ``save`` did.

    Attributes:
        files: the files written, .ptd files first, in publish order.
        nbytes: bytes written in all.
        seconds: wall time from plan to the last publish.
        gbps: ``nbytes / seconds / 1e9`` (GB/s).
        dedup_saved_nbytes: bytes not written because equal data was already
            stored under another key.
        plan_seconds: the part of ``seconds`` spent planning.
        options: the layout parameters used.
    """

    files: Tuple[FileReport, ...]
    nbytes: int
    seconds: float
    gbps: float
    dedup_saved_nbytes: int
    plan_seconds: float
    options: PteOptions
    manifest_path: Optional[str] = None

    def summary(self) -> str:
        lines = [f"{f.path}  {f.nbytes:,} bytes" for f in self.files]
        lines.append(
            f"{self.nbytes:,} bytes in {self.seconds:.2f} s ({self.gbps:.2f} GB/s); "
            f"dedup saved {self.dedup_saved_nbytes:,} bytes"
        )
        return "\n".join(lines)


@dataclass(frozen=True)
class SavePlan:
    """The plans of every file of one save, in publish order (.ptd first, .pte last)."""

    files: Tuple[Tuple[str, FilePlan], ...]
    options: PteOptions
    dedup_saved_nbytes: int

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for _, p in self.files)


def ptd_file_name(tag: str) -> str:
    """``<tag>.ptd`` (upstream appends ``.ptd`` unless the tag ends with it).

    Any tag upstream writes inside the output folder is accepted (``""`` gives
    ``.ptd``, ``".."`` gives ``...ptd``).

    Raises:
        LayoutError: a tag whose file name would hold a path separator or NUL,
            or be absolute: it would name a file outside the output folder (or
            none at all).
    """
    if not isinstance(tag, str):
        raise LayoutError(f"external tag {tag!r} is not a str")
    name = tag if tag.endswith(".ptd") else tag + ".ptd"
    bad = [c for c in ("/", os.sep, os.altsep, "\0") if c and c in name]
    if bad or os.path.isabs(name) or name in (".", ".."):
        raise LayoutError(
            f"external tag {tag!r} holds {bad[0] if bad else 'an absolute path'!r}: "
            "a tag names a file in the output folder and may not leave it"
        )
    return name


def plan_manager_pte(parts: dict, options: PteOptions, name: str) -> FilePlan:
    """Plan the manager's .pte from its parts (see ``_upstream.manager_parts``)."""
    named = parts["named_data"]
    buffers: List[Source] = []
    pte_data = None
    if named is not None and len(named.buffers) > 0 and len(named.pte_data) > 0:
        buffers = _buffer_sources(named.buffers)
        pte_data = named.pte_data
    return plan_pte(
        parts["program"],
        mutable_data=parts["mutable_data"],
        named_buffers=buffers,
        named_data=pte_data,
        options=options,
        name=name,
    )


def _buffer_sources(buffers) -> List[Source]:
    return [as_source(b, label=f"buffer {i}") for i, b in enumerate(buffers)]


def _ptd_payloads(parts: dict, store: StreamingNamedDataStore):
    """``[(tag, buffers, {key: DataEntry}, fingerprints)]`` as upstream would serialize."""
    named = parts["named_data"]
    constant_map = parts["external_constant_map"]
    if len(constant_map) == 0:
        if named is None or len(named.external_data) == 0:
            return []
        buffers = _buffer_sources(named.buffers)
        return [(tag, buffers, entries, {}) for tag, entries in named.external_data.items()]
    layouts = _upstream.external_tensor_layouts(parts["program"])
    constants = parts["external_constant_buffer"]
    sources: Dict[int, Source] = {}
    for tag, fqn_to_index in constant_map.items():
        for fqn, index in fqn_to_index.items():
            if index not in sources:
                sources[index] = as_source(constants[index], label=f"constant {fqn!r}")
            store.add_named_data(
                fqn, sources[index], tensor_layout=layouts[fqn], external_tag=tag
            )
    if named is not None:
        store.merge_named_data_store(named)
    fps = store.get_named_data_store_output().fingerprints
    return [(tag, store.buffers, entries, fps) for tag, entries in store.external_data.items()]


def plan_manager(
    manager,
    path: str,
    *,
    config: Any = None,
    data_dir: Optional[str] = None,
    ring: Optional[BufferRing] = None,
) -> SavePlan:
    """Plan every file ``save`` would write, without writing anything.

    Args:
        manager: an ``ExecutorchProgramManager``.
        path: the .pte path; must end with ``.pte``.
        config: ``ExecutorchBackendConfig`` or :class:`PteOptions`; by default the
            recorded or inferred one (:mod:`ptdstream.config`).
        data_dir: folder of the .ptd files (default: the .pte's folder).

    Raises:
        ValueError: ``path`` does not end with ``.pte`` (upstream's check), or
            upstream's store errors (duplicate key with different data).
        LayoutError: a bad external tag, or parameters that cannot be resolved.
    """
    from .config import resolve_options

    path = os.fspath(path)
    if not path.endswith(".pte"):
        raise ValueError(f"Path {path} does not end with .pte")
    parts = _upstream.manager_parts(manager)
    options = resolve_options(manager, config, parts)
    folder = data_dir if data_dir is not None else (os.path.dirname(path) or ".")
    store = StreamingNamedDataStore(ring)
    files: List[Tuple[str, FilePlan]] = []
    for tag, buffers, entries, fps in _ptd_payloads(parts, store):
        name = ptd_file_name(tag)
        plan = plan_ptd(
            buffers, entries, segment_alignment=parts["ptd_segment_alignment"], name=name,
            fingerprints=fps,
        )
        files.append((os.path.join(folder, name), plan))
    files.append((path, plan_manager_pte(parts, options, os.path.basename(path))))
    return SavePlan(tuple(files), options, store.dedup_saved_nbytes)


def _has_cuda_sources(plan: SavePlan) -> bool:
    """Whether any payload comes from a CUDA tensor: there O_DIRECT measured
    faster (benchmarks/bench_cuda.py on an H200: 1.88 vs 1.64 GB/s for 8 GiB, 1.59
    vs 1.49 GB/s for 32 GiB); for CPU sources the measurements here were mixed,
    so those keep buffered writes with page dropping."""
    from .plan import iter_sources

    for _, extent in iter_sources(f for _, f in plan.files):
        if type(extent.source).__name__ == "CudaTensorSource":
            return True
    return False


def write_save_plan(
    plan: SavePlan,
    *,
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
    window_nbytes: int = DEFAULT_WINDOW_NBYTES,
    progress: Optional[Callable[[int], None]] = None,
    sink_factory: Callable[[str], ChunkedFileSink] = None,
    direct: Optional[bool] = None,
) -> List[FileReport]:
    """Write every file of ``plan`` to temp files, sync them all, then publish.

    On any error every temp file is removed and nothing is published.
    """
    ring = BufferRing(chunk_nbytes, count=2)
    for target, _ in plan.files:
        remove_stale_temp_files(target)
    if direct is None:
        direct = _has_cuda_sources(plan)
    make = sink_factory or (
        lambda p: ChunkedFileSink(p, window_nbytes=window_nbytes, direct=direct)
    )
    sinks: List[ChunkedFileSink] = []
    reports: List[FileReport] = []
    try:
        for target, fplan in plan.files:
            sink = make(target)
            sinks.append(sink)
            fps = write_plan(fplan, sink, ring, progress)
            sink.sync()
            reports.append(
                FileReport(sink.target, fplan.kind, fplan.nbytes, fplan.payload_nbytes(), fps)
            )
        with folder_locks(sorted({os.path.dirname(s.target) for s in sinks})):
            publish_set(sinks)
    except BaseException:
        for sink in sinks:
            sink.abort()
        raise
    return reports


def save(
    manager,
    path: str,
    *,
    config: Any = None,
    data_dir: Optional[str] = None,
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
    window_nbytes: int = DEFAULT_WINDOW_NBYTES,
    progress: Any = False,
    manifest: bool = False,
    direct: Optional[bool] = None,
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
            (otherwise recorded or read back: :mod:`ptdstream.config`).
        data_dir: folder of the .ptd files (default: the .pte's folder).
        chunk_nbytes: piece size in bytes (8 MiB).
        window_nbytes: bytes between page-cache drops (64 MiB).
        progress: ``True`` for a tqdm bar on stderr, a callable taking the bytes
            of each piece, or ``False``.
        direct: write with O_DIRECT (no page cache; falls back to buffered
            writes where the file system refuses it). ``None`` (default): O_DIRECT
            when a payload comes from a CUDA tensor, where it measured faster,
            else buffered writes with page dropping.
        manifest: also write ``<stem>.manifest`` beside the .pte
            (:mod:`ptdstream.manifest`): piece digests, sections and key
            fingerprints of every file written, read back from disk once.

    Returns:
        A :class:`SaveReport` (files, bytes, seconds, GB/s, dedup savings).

    Raises:
        ValueError, LayoutError: bad path, tag or parameters (nothing written).
        IntegrityError: a source changed or vanished (nothing published).
        OSError: a write, fsync or rename failed (nothing published).
    """
    start = time.perf_counter()
    plan = plan_manager(manager, path, config=config, data_dir=data_dir)
    plan_seconds = time.perf_counter() - start
    bar = None
    callback = progress if callable(progress) else None
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, desc=f"saving {len(plan.files)} file(s) of {os.path.basename(path)}")
        callback = bar.update
    try:
        reports = write_save_plan(
            plan, chunk_nbytes=chunk_nbytes, window_nbytes=window_nbytes, progress=callback,
            direct=direct,
        )
    finally:
        if bar is not None:
            bar.close()
    manifest_path = None
    if manifest:
        from .manifest import write_manifest

        manifest_path = os.path.splitext(os.fspath(path))[0] + ".manifest"
        write_manifest([r.path for r in reports], manifest_path)
    seconds = time.perf_counter() - start
    nbytes = sum(r.nbytes for r in reports)
    return SaveReport(
        files=tuple(reports),
        nbytes=nbytes,
        seconds=seconds,
        gbps=nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        dedup_saved_nbytes=plan.dedup_saved_nbytes,
        plan_seconds=plan_seconds,
        options=plan.options,
        manifest_path=manifest_path,
    )


def write_data_files(
    store: StreamingNamedDataStore,
    folder: str,
    *,
    segment_alignment: int = 128,
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
    window_nbytes: int = DEFAULT_WINDOW_NBYTES,
    progress: Optional[Callable[[int], None]] = None,
    direct: Optional[bool] = None,
) -> List[FileReport]:
    """Write each external tag of ``store`` as ``folder/<tag>.ptd`` (embedding API).

    For exporters that build a :class:`StreamingNamedDataStore` themselves: the
    files equal what ``FlatTensorSerializer`` gives for the same store. All files
    are synced before any is published; on error none is.

    Raises:
        LayoutError: a tag that would leave ``folder``.
        IntegrityError, OSError: as :func:`save` (nothing published).
    """
    out = store.get_named_data_store_output()
    files = []
    for tag, entries in out.external_data.items():
        name = ptd_file_name(tag)
        plan = plan_ptd(
            out.buffers, entries, segment_alignment=segment_alignment, name=name,
            fingerprints=out.fingerprints,
        )
        files.append((os.path.join(folder, name), plan))
    save_plan = SavePlan(tuple(files), PteOptions(segment_alignment=segment_alignment), store.dedup_saved_nbytes)
    return write_save_plan(
        save_plan, chunk_nbytes=chunk_nbytes, window_nbytes=window_nbytes, progress=progress,
        direct=direct,
    )
