"""Many ranks, one artifact: every rank of a ``torch.distributed`` group writes the
bytes it holds into the shared ``.ptd`` files, at offsets one plan fixed.

Protocol (every step is collective; a failure on any rank is reported to all,
and nothing is published):

1. each rank describes its pieces: key, tag, alignment, the whole tensor's
   layout, the piece's place among the key's pieces (mesh coordinate), its size
   and first 32 bytes; ``all_gather_object``;
2. every rank derives the same global order and the keys whose size and first
   32 bytes collide with another's (upstream's dedup candidates); each rank
   digests its pieces of those keys with the composable fingerprint
   (:mod:`ptdstream.distributed.fingerprint`); ``all_gather_object``;
3. rank 0 plans every ``<tag>.ptd`` with ptdstream's store and planner (the
   planner sees sizes, first bytes and fingerprints only), creates the temp
   files at their full size and broadcasts ``(temp file, key, file offset)``;
4. each rank writes its own pieces with ``pwrite`` (the first key of each dedup class
   only), fsyncs and drops their pages; rank 0 writes each head and fsyncs;
5. a barrier (status exchange), then rank 0 publishes the set atomically
   (:func:`ptdstream.write.publish.publish_set`) and tells every rank the outcome.

No rank reads another rank's bytes. The result equals
``ptdstream.save.write_data_files`` of a store to which the whole tensors were
added in the global order: rank 0's keys in its order, then rank 1's new keys,
and so on (DTensor keys are on every rank, so their order is rank 0's).
"""

from __future__ import annotations

import contextlib
import os
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from ..defaults import CHUNK_NBYTES, WINDOW_NBYTES
from ..errors import IntegrityError, LayoutError, PtdstreamError
from ..sources import BufferRing, Source, as_source
from .fingerprint import combine, digest_piece
from .plan import PREFIX_NBYTES, PieceInfo, collate, dedup_candidates, plan_files, wire_plan


class DistributedWriteError(PtdstreamError):
    """A rank failed; raised on every rank, naming each failed rank and its error.
    Nothing was published and the temp files are removed."""


@dataclass(frozen=True)
class DistributedReport:
    """What :func:`write_data_files` did: ``files`` ``[(path, bytes)]`` published,
    bytes this rank wrote, wall seconds, bytes saved by dedup."""

    files: Tuple[Tuple[str, int], ...]
    rank_nbytes: int
    seconds: float
    dedup_saved_nbytes: int


def _dist():
    import torch.distributed as dist

    return dist


@contextlib.contextmanager
def _group_failures():
    """A collective that fails (a rank killed, a timeout) as :class:`DistributedWriteError`."""
    try:
        yield
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise DistributedWriteError(f"the group failed (a rank was killed, timed out or left): "
                                    f"{type(e).__name__}: {first}; nothing was published") from e


def _exchange(value: Any, error: Optional[BaseException], group) -> List[Any]:
    """``all_gather_object`` of ``value``, or of this rank's error: raises
    :class:`DistributedWriteError` on every rank when any rank failed."""
    dist = _dist()
    mine = ("error", f"{type(error).__name__}: {error}") if error is not None else ("ok", value)
    gathered: List[Any] = [None] * dist.get_world_size(group)
    with _group_failures():
        dist.all_gather_object(gathered, mine, group=group)
    failed = [(r, g[1]) for r, g in enumerate(gathered) if g[0] == "error"]
    if failed:
        raise DistributedWriteError(
            "; ".join(f"rank {r}: {msg}" for r, msg in failed) + "; nothing was published"
        ) from error
    return [g[1] for g in gathered]


def _broadcast(value: Any, error: Optional[BaseException], group) -> Any:
    """Rank 0's ``value`` (or its error, raised on every rank)."""
    dist = _dist()
    box = [("error", f"{type(error).__name__}: {error}") if error is not None else ("ok", value)]
    with _group_failures():
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    status, payload = box[0]
    if status == "error":
        raise DistributedWriteError(f"rank 0: {payload}; nothing was published") from error
    return payload


def _local_pieces(tensors: Mapping[str, Any], tag_of: Callable[[str], str], alignment: int, rank: int):
    """``[PieceInfo]`` and ``{key: (source, tensor, first bytes)}`` of this rank's pieces."""
    import torch
    from executorch.exir.tensor import scalar_type_enum
    from executorch.exir.tensor_layout import TensorLayout

    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - torch without DTensor
        DTensor = ()
    infos: List[PieceInfo] = []
    local: Dict[str, Tuple[Source, Any, bytes]] = {}
    for key, tensor in tensors.items():
        if not isinstance(key, str):
            raise LayoutError(f"key {key!r} is not a str")
        if isinstance(tensor, DTensor):
            mesh = tensor.device_mesh
            if mesh.ndim != 1:
                raise LayoutError(f"key {key!r}: a DTensor on a {mesh.ndim}-D mesh; only 1-D meshes are supported")
            placement = tensor.placements[0]
            if not (placement.is_replicate() or (placement.is_shard() and placement.dim == 0)):
                # Rows of a Shard(0) tensor are byte ranges of the whole: DTensor moves the data.
                tensor = tensor.redistribute(mesh, [Shard(0)])
                placement = tensor.placements[0]
            coordinate = mesh.get_coordinate()[0]
            piece = tensor.to_local()
            if placement.is_replicate():
                # One rank writes a replicated tensor, the same on every rank whatever the
                # order of its other keys; spread over the ranks by the key's CRC-32.
                owner = zlib.crc32(key.encode()) % mesh.size()
                if coordinate != owner:
                    piece = piece[:0]
                coordinate = 0 if coordinate == owner else 1
            scalar = int(scalar_type_enum(tensor.dtype))
            sizes, dim_order = tuple(int(s) for s in tensor.shape), tuple(range(tensor.dim()))
            total = tensor.numel() * tensor.element_size()
            sharded = True
            if not piece.is_contiguous():
                piece = piece.contiguous()
        elif isinstance(tensor, torch.Tensor):
            piece, coordinate, sharded = tensor.detach(), 0, False
            try:  # the single-process store's layout: contiguous or channels_last only
                layout = TensorLayout.from_tensor(piece)
            except ValueError as e:
                raise LayoutError(f"key {key!r}: {e}") from None
            scalar = int(layout.scalar_type)
            sizes = tuple(int(s) for s in layout.sizes)
            dim_order = tuple(int(d) for d in layout.dim_order)
            total = piece.numel() * piece.element_size()
        else:
            raise LayoutError(f"key {key!r}: a {type(tensor).__name__}, not a tensor or DTensor")
        source = as_source(piece, label=f"rank {rank} key {key!r}")
        head = source.prefix(PREFIX_NBYTES)
        infos.append(PieceInfo(key, tag_of(key), alignment, scalar, sizes, dim_order, total, coordinate,
                               sharded, source.nbytes, head, rank))
        local[key] = (source, piece, head)
    return infos, local


def _write_pieces(wire, local, offsets, rank: int, chunk_nbytes: int) -> int:
    """pwrite this rank's pieces into the temp files, window by window to disk and
    out of the page cache (:class:`~ptdstream.system.writeback.WritebackWindows`);
    fsync; drop their pages."""
    from ..system.files import pwrite_all
    from ..system.pagecache import drop_pages
    from ..system.writeback import WritebackWindows

    ring = BufferRing(chunk_nbytes, count=1)
    written = 0
    for target, temp, _, writes in wire:
        mine = [(key, at) for key, at, _ in writes if key in local and local[key][0].nbytes]
        if not mine:
            continue
        fd = os.open(temp, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        writeback = WritebackWindows(fd)
        try:
            for key, at in mine:
                position = at + offsets[(key, rank)]
                source, _, head = local[key]
                if source.prefix(len(head)) != head:
                    raise IntegrityError(f"rank {rank}: key {key!r} changed since the plan (its first bytes "
                                         f"differ) before it was written to {temp} at offset {position}")
                for piece in source.pieces(ring):
                    n = pwrite_all(fd, piece, position)
                    writeback.written(position, n)
                    position += n
                    written += n
            writeback.close()
            os.fsync(fd)
            drop_pages(fd, 0, 0)
        except OSError as e:
            raise OSError(e.errno, f"rank {rank}: writing {temp} (for {target}) failed: {e.strerror}") from e
        finally:
            try:
                writeback.close()  # its thread has ended, even when Ctrl-C comes
            finally:
                os.close(fd)
    return written


def write_data_files(
    tensors: Mapping[str, Any],
    folder: str,
    *,
    external_tag: Union[str, Callable[[str], str]] = "model",
    alignment: int = 1,
    group=None,
    segment_alignment: int = 128,
    chunk_nbytes: int = CHUNK_NBYTES,
) -> DistributedReport:
    """Write ``folder/<tag>.ptd`` from the tensors of every rank; call it on every
    rank of ``group`` (default: the default process group) with its own tensors.

    Args:
        tensors: ``{key: tensor}`` this rank holds, in order: CPU or CUDA tensors
            (a key on one rank only) or DTensors on a 1-D mesh of ``group``
            (every rank passes the key; ``Shard(0)`` and ``Replicate`` are written
            as they lie, other placements are first redistributed to
            ``Shard(0)`` with DTensor's ``redistribute``).
        folder: existing folder on a file system every rank sees.
        group: the process group (gloo or NCCL; with NCCL, set each rank's CUDA
            device first: the plan travels by object collectives).
        external_tag: the tag of every key, or ``key -> tag``.
        alignment: bytes, of every entry (upstream's ``add_named_data`` alignment).
        segment_alignment: bytes (the ``FlatTensorSerializer``'s, 128).
        chunk_nbytes: piece size in bytes for reading and writing.

    Returns:
        A :class:`DistributedReport` on every rank.

    Raises:
        DistributedWriteError: on every rank, when any rank failed (its error is
            named); nothing is published and the temp files are removed.
    """
    dist = _dist()
    start = time.perf_counter()
    rank = dist.get_rank(group)
    folder = os.path.abspath(os.fspath(folder))
    tag_of = external_tag if callable(external_tag) else (lambda key: external_tag)
    local, error, infos = {}, None, None
    try:
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{folder}: output folder does not exist (rank {rank})")
        infos, local = _local_pieces(tensors, tag_of, alignment, rank)
    except Exception as e:  # reported to every rank
        error = e
    all_infos = _exchange(infos, error, group)
    error, order = None, None
    try:
        order, pieces, offsets = collate(all_infos)
        heads, candidates = dedup_candidates(order, pieces)
        partial = {key: digest_piece(local[key][0].pieces(BufferRing(chunk_nbytes, count=1)), offsets[(key, rank)])
                   for key in order if key in candidates and key in local}
    except Exception as e:
        error, partial = e, None
    all_partials = _exchange(partial, error, group)
    sinks, error, wire, files, dedup = [], None, None, [], 0
    if rank == 0:
        try:
            fingerprints = {key: combine(pieces[key][0].total_nbytes, [p[key] for p in all_partials if key in p])
                            for key in candidates}
            files, dedup = plan_files(order, pieces, heads, fingerprints, segment_alignment, folder)
            sinks = _create_temp_files(files)
            wire = wire_plan(files, sinks)
        except Exception as e:
            error = e
    try:
        wire = _broadcast(wire, error, group)
        error, written = None, 0
        try:
            written = _write_pieces(wire, local, offsets, rank, chunk_nbytes)
            if rank == 0:
                for (_, plan), sink in zip(files, sinks):
                    sink.write(plan.extents[0].data)  # the head: header + FlatTensor flatbuffer + padding
                    sink.sync()
        except Exception as e:
            error = e
        _exchange(written, error, group)  # every rank has fsynced: the barrier before publishing
        error = None
        if rank == 0:
            try:
                from ..write.publish import folder_locks, publish_set

                with folder_locks([folder]):
                    publish_set(sinks)
            except Exception as e:
                error = e
        published = _broadcast([(t, n) for t, _, n, _ in wire], error, group)
    except BaseException:
        for sink in sinks:
            sink.abort()
        raise
    return DistributedReport(tuple(published), written, time.perf_counter() - start, dedup)


def _create_temp_files(files):
    """Rank 0: a sink (temp file) per file, at its full size (the gaps read as zeros)."""
    from ..write.publish import prepare_folders
    from ..write.sink import ChunkedFileSink

    prepare_folders(target for target, _ in files)  # once per folder, before any temp file
    sinks = []
    try:
        for target, plan in files:
            sink = ChunkedFileSink(target, window_nbytes=WINDOW_NBYTES, clean_folder=False)
            sinks.append(sink)
            os.truncate(sink.temp_path, plan.nbytes)
    except BaseException:
        for sink in sinks:
            sink.abort()
        raise
    return sinks
