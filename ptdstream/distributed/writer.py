"""Many ranks, one artifact: every rank of a ``torch.distributed`` group writes the
bytes it holds into the shared ``.ptd`` files, at offsets one plan fixed.

Protocol: five steps, each run on every rank (or on rank 0) through one
:class:`~ptdstream.distributed.collective.Collective`, so that a failure on any
rank is raised on every rank, naming each failed rank, and nothing is published:

1. ``describe the pieces``: each rank takes its pieces at hand-over (a CPU piece
   the caller may still change is fingerprinted now, as the single-process
   store does; a CUDA piece gets its GPU fingerprint) and describes them: key,
   tag, alignment, the whole tensor's layout, the piece's place among the key's
   pieces (mesh coordinate), its size and first 32 bytes; all-gathered;
2. ``fingerprint the dedup candidates``: every rank derives the same global order
   and the keys whose size and first 32 bytes collide with another's (upstream's
   dedup candidates); each rank digests its pieces of those keys with the
   composable fingerprint (:mod:`ptdstream.distributed.fingerprint`), checking
   in the same pass that they are still the bytes handed over; all-gathered;
3. ``plan the files`` (rank 0): every ``<tag>.ptd`` planned with ptdstream's store
   and planner (which see sizes, first bytes and fingerprints only), the temp
   files created at their full size; ``(temp file, key, file offset)`` broadcast;
4. ``write the pieces``: each rank writes its own pieces with ``pwrite`` (the
   first key of each dedup class only), digesting every piece as written and
   refusing one whose digest differs from the hand-over's; fsyncs and drops
   their pages; rank 0 writes each head; all-gathered (the barrier);
5. ``publish`` (rank 0): the set published atomically
   (:func:`ptdstream.write.publish.publish_set`), the outcome broadcast.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..defaults import CHUNK_NBYTES, WINDOW_NBYTES
from ..errors import IntegrityError, LayoutError
from ..progress import check_progress, progress_callback
from ..reports import Report
from ..sources import BufferRing, Source, as_source
from ..sources.fingerprint import StreamingDigest, check_expected
from .collective import Collective, DistributedIntegrityError, DistributedWriteError
from .fingerprint import combine, digest_piece
from .plan import (
    PREFIX_NBYTES,
    PieceInfo,
    check_local_shape,
    collate,
    dedup_candidates,
    plan_files,
    store_layout,
    wire_plan,
)

__all__ = ["DistributedIntegrityError", "DistributedReport", "DistributedWriteError", "write_data_files"]


@dataclass(frozen=True)
class DistributedReport(Report):
    """What :func:`write_data_files` did: ``files`` ``[(path, bytes)]`` published,
    bytes this rank wrote, wall seconds, bytes saved by dedup."""

    files: tuple[tuple[str, int], ...]
    rank_nbytes: int
    seconds: float
    dedup_saved_nbytes: int

    def summary(self) -> str:
        lines = [f"{path}  {nbytes:,} bytes" for path, nbytes in self.files]
        lines.append(f"{self.rank_nbytes:,} bytes written by this rank in {self.seconds:.2f} s; "
                     f"dedup saved {self.dedup_saved_nbytes:,} bytes")
        return "\n".join(lines)


def _local_pieces(tensors: Mapping[str, Any], tag_of: Callable[[str], str], alignment: int, rank: int):
    """``[PieceInfo]`` and ``{key: (source, tensor, first bytes)}`` of this rank's
    pieces, taken at hand-over: a CPU piece the caller can still change carries its
    xxh3-128 digest (:meth:`~ptdstream.sources.base.Source.hand_over`), a CUDA piece its
    GPU fingerprint, checked again when the piece is written.

    A 0-dim DTensor is written whole by one rank (a ``Partial`` one is first
    redistributed to ``Replicate``); a shard that holds no rows is a piece of 0 bytes.
    A ``Replicate`` DTensor has its local tensor's layout (channels_last kept), a
    ``Shard(0)`` one the row-major layout of its whole.

    Raises:
        LayoutError: a key that is not a str, a value that is not a tensor, a
            layout the single-process store refuses, a DTensor on a mesh of more
            than one dimension, a local tensor of another shape than its placement
            gives, a ``Shard(0)`` DTensor or local tensor that is not row-major.
    """
    import torch
    from executorch.exir.tensor import scalar_type_enum

    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # pragma: no cover - torch without DTensor
        DTensor = ()  # type: ignore[misc, assignment]  # no DTensor class: isinstance(x, ()) is False
    infos: list[PieceInfo] = []
    local: dict[str, tuple[Source, Any, bytes]] = {}
    for key, tensor in tensors.items():
        if not isinstance(key, str):
            raise LayoutError(f"key {key!r} is not a str")
        private = False  # a copy made here, which the caller cannot change
        if isinstance(tensor, DTensor):
            mesh = tensor.device_mesh
            if mesh.ndim != 1:
                raise LayoutError(f"key {key!r}: a DTensor on a {mesh.ndim}-D mesh; only 1-D meshes are supported")
            placement = tensor.placements[0]
            strides = list(tensor.stride())  # the whole's, as the caller passed it
            dense = torch.empty_strided(tensor.shape, tensor.stride(), device="meta").is_contiguous()
            if tensor.dim() == 0 and not placement.is_replicate():
                tensor, private = tensor.redistribute(mesh, [Replicate()]), True  # a scalar has no rows
                placement = tensor.placements[0]
            elif not (placement.is_replicate() or placement.is_shard(dim=0)):
                # Rows of a Shard(0) tensor are byte ranges of the whole: DTensor moves the data.
                tensor, private = tensor.redistribute(mesh, [Shard(0)]), True
                placement = tensor.placements[0]
            coordinate = mesh.get_coordinate()[0]  # type: ignore[index]  # None only off the mesh; this rank is on it
            piece = tensor.to_local()
            scalar = int(scalar_type_enum(tensor.dtype))
            sizes, dim_order = tuple(int(s) for s in tensor.shape), tuple(range(tensor.dim()))
            check_local_shape(key, tuple(piece.shape), sizes, placement.is_shard(), mesh.size(), coordinate)
            if placement.is_replicate():
                dim_order = store_layout(key, piece)[2]  # as one process: contiguous or channels_last
                # One rank writes a replicated tensor, the same on every rank whatever the
                # order of its other keys; spread over the ranks by the key's CRC-32.
                owner = zlib.crc32(key.encode()) % mesh.size()
                if coordinate != owner:
                    piece = piece.new_empty(0)  # no bytes
                coordinate = 0 if coordinate == owner else 1
            elif not (dense and (private or piece.numel() == 0 or piece.is_contiguous())):
                raise LayoutError(f"key {key!r}: a Shard(0) DTensor of strides {strides}, its local "
                                  f"tensor of strides {list(piece.stride())}: not contiguous, so its rows are not "
                                  "byte ranges of the whole as one process writes it (channels_last included); make "
                                  "the tensor contiguous before sharding it, or pass a Replicate() DTensor")
            total = tensor.numel() * tensor.element_size()
            sharded = True
            if placement.is_shard() and not piece.is_contiguous():  # redistributed by DTensor from a row-major whole
                piece, private = piece.contiguous(), True
            if piece.numel() == 0:  # no bytes; its storage offset may lie past its (empty) storage
                piece, private = piece.new_empty(piece.shape), True
        elif isinstance(tensor, torch.Tensor):
            piece, coordinate, sharded = tensor.detach(), 0, False
            scalar, sizes, dim_order = store_layout(key, piece)
            total = piece.numel() * piece.element_size()
        else:
            raise LayoutError(f"key {key!r}: a {type(tensor).__name__}, not a tensor or DTensor")
        source = _handed_over(piece, f"rank {rank} key {key!r}", fingerprint=not private)
        head = source.prefix(PREFIX_NBYTES)
        infos.append(PieceInfo(key, tag_of(key), alignment, scalar, sizes, dim_order, total, coordinate,
                               sharded, source.nbytes, head, rank, str(placement) if sharded else ""))
        local[key] = (source, piece, head)
    return infos, local


def _handed_over(piece, label: str, fingerprint: bool) -> Source:
    """The source of a piece, with the fingerprint it is checked against when
    written: the xxh3-128 of a CPU piece (:meth:`~ptdstream.sources.base.Source.hand_over`),
    the GPU fingerprint of a CUDA piece (checked once its bytes are copied out, as
    :mod:`ptdstream.hooks.cuda.backend` does). ``fingerprint=False`` for a copy the
    writer made itself (nobody else can change it)."""
    if not (fingerprint and piece.numel()):
        return as_source(piece, label=label)
    if piece.is_cuda:
        import torch

        from ..sources.base import Expectation
        from ..sources.cuda import CudaTensorSource
        from ..sources.cuda_fingerprint import gpu_fingerprint

        now = gpu_fingerprint(piece.reshape(-1).view(torch.uint8))
        return CudaTensorSource(piece, label=label, expectation=Expectation(gpu_fingerprint=now))
    return as_source(piece, label=label).hand_over()


def _candidate_digest(source: Source, offset: int, ring: BufferRing):
    """The composable digest of a dedup candidate's piece at ``offset`` (bytes) in
    the whole, checked in the same pass against the xxh3-128 taken at hand-over.

    Raises:
        IntegrityError: the bytes are no longer those handed over (both digests).
    """
    seen = StreamingDigest()

    def tee():
        for piece in source.pieces(ring):
            seen.update(piece)
            yield piece

    part = digest_piece(tee(), offset)
    now, expected = seen.finish(), source.expectation.fingerprint
    if expected is not None and now != expected:
        raise IntegrityError(f"{source.describe()} changed after it was handed over (digest {now.hex} before the "
                             f"plan != {expected.hex} when handed over); nothing was published")
    return part


def _write_pieces(wire, local, offsets, rank: int, chunk_nbytes: int, progress: Callable[[int], object]) -> int:
    """pwrite this rank's pieces into the temp files, window by window to disk and
    out of the page cache (:class:`~ptdstream.system.writeback.WritebackWindows`),
    digesting each piece as written, ``progress(bytes)`` after each; fsync; drop
    their pages.

    Raises:
        IntegrityError: a piece whose first bytes, size or digest differ from
            those taken at hand-over (naming rank, key, file and offset).
        OSError: a write failed (naming rank and file).
    """
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
                source, _, head = local[key]
                position = at + offsets[(key, rank)]
                where = f"{target} at offset {position}: "
                digest = StreamingDigest()
                for piece in _pieces_of(source, ring, where):
                    if digest.nbytes == 0 and bytes(piece[: len(head)]) != head[: len(piece)]:
                        raise IntegrityError(f"{where}{source.describe()} changed after it was handed over (its "
                                             "first bytes differ from the plan's); nothing was published")
                    if digest.nbytes + len(piece) > source.nbytes:
                        raise IntegrityError(f"{where}{source.describe()} gave more than the {source.nbytes} "
                                             "bytes planned; nothing was published")
                    n = pwrite_all(fd, piece, position)
                    writeback.written(position, n)
                    digest.update(piece)  # the bytes as written (or later)
                    position += n
                    written += n
                    progress(n)
                if digest.nbytes != source.nbytes:
                    raise IntegrityError(f"{where}{source.describe()} gave {digest.nbytes} bytes, "
                                         f"{source.nbytes} planned; nothing was published")
                check_expected(source, digest.finish(), where)
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


def _pieces_of(source: Source, ring: BufferRing, where: str):
    """``source.pieces(ring)``, its IntegrityError (storage freed, GPU fingerprint
    changed) prefixed with the file and offset."""
    pieces = source.pieces(ring)
    while True:
        try:
            piece = next(pieces)
        except StopIteration:
            return
        except IntegrityError as e:
            raise IntegrityError(f"{where}{e}") from e
        yield piece


class _RankWrite:
    """One rank's part of one write. Its steps, in order, each run on every rank
    (or on rank 0) by :class:`Collective`: 1) ``describe`` 2) ``fingerprint``
    3) ``plan`` (rank 0) 4) ``write`` 5) ``publish`` (rank 0); ``abort`` after a
    failure removes rank 0's temp files."""

    def __init__(self, tensors, folder: str, tag_of, alignment: int, rank: int, segment_alignment: int,
                 chunk_nbytes: int, progress: Any) -> None:
        self.tensors, self.folder, self.tag_of, self.alignment = tensors, folder, tag_of, alignment
        self.rank, self.segment_alignment, self.chunk_nbytes = rank, segment_alignment, chunk_nbytes
        self.progress = progress
        self.local: dict[str, tuple[Source, Any, bytes]] = {}
        self.sinks: list[Any] = []
        self.files: list[Any] = []
        self.published = False

    def describe(self) -> list[PieceInfo]:
        check_progress(self.progress)
        if not os.path.isdir(self.folder):
            raise FileNotFoundError(f"{self.folder}: output folder does not exist (rank {self.rank})")
        infos, self.local = _local_pieces(self.tensors, self.tag_of, self.alignment, self.rank)
        return infos

    def fingerprint(self, all_infos: list[list[PieceInfo]]) -> dict[str, Any]:
        self.order, self.pieces, self.offsets = collate(all_infos)
        self.heads, self.candidates = dedup_candidates(self.order, self.pieces)
        ring = BufferRing(self.chunk_nbytes, count=1)
        return {key: _candidate_digest(self.local[key][0], self.offsets[(key, self.rank)], ring)
                for key in self.order if key in self.candidates and key in self.local}

    def plan(self, all_partials: list[dict[str, Any]]):
        """Rank 0: ``(wire plan, bytes saved by dedup)``."""
        fingerprints = {key: combine(self.pieces[key][0].total_nbytes, [p[key] for p in all_partials if key in p])
                        for key in self.candidates}
        self.files, dedup = plan_files(self.order, self.pieces, self.heads, fingerprints, self.segment_alignment,
                                       self.folder)
        self.sinks = _create_temp_files(self.files)
        return wire_plan(self.files, self.sinks), dedup

    def write(self, wire) -> int:
        mine = sum(self.local[key][0].nbytes for _, _, _, writes in wire for key, _, _ in writes if key in self.local)
        with contextlib.ExitStack() as stack:
            update = progress_callback(stack, self.progress, mine, f"rank {self.rank}: writing its pieces")
            written = _write_pieces(wire, self.local, self.offsets, self.rank, self.chunk_nbytes, update)
        if self.rank == 0:
            for (_, plan), sink in zip(self.files, self.sinks, strict=True):
                sink.write(plan.extents[0].data)  # the head: header + FlatTensor flatbuffer + padding
                sink.sync()
        return written

    def publish(self, wire) -> list[tuple[str, int]]:
        from ..write.publish import folder_locks, publish_set

        with folder_locks([self.folder]):
            publish_set(self.sinks)
        self.published = True
        return [(t, n) for t, _, n, _ in wire]

    def abort(self) -> None:
        for sink in self.sinks:
            sink.abort()


def write_data_files(
    tensors: Mapping[str, Any],
    folder: str,
    *,
    external_tag: str | Callable[[str], str] = "model",
    alignment: int = 1,
    group=None,
    segment_alignment: int = 128,
    chunk_nbytes: int = CHUNK_NBYTES,
    progress: Any = False,
) -> DistributedReport:
    """Write ``folder/<tag>.ptd`` from the tensors of every rank; call it on every
    rank of ``group`` (default: the default process group) with its own tensors.

    The tensors are handed over by the call: the bytes written are those they
    held when it began. A piece changed while the call runs is refused (its
    digest as written differs from the one taken at hand-over), as
    :func:`ptdstream.save.write_data_files` refuses a changed source.

    Args:
        tensors: ``{key: tensor}`` this rank holds, in order: CPU or CUDA tensors
            (a key on one rank only; 0-dim included) or DTensors on a 1-D mesh of
            ``group`` (every rank passes the key; ``Shard(0)`` and ``Replicate``
            are written as they lie, a shard may hold no rows; other placements
            are first redistributed to ``Shard(0)``, of a 0-dim DTensor to
            ``Replicate``, with DTensor's ``redistribute``).
        folder: existing folder on a file system every rank sees.
        group: the process group (gloo or NCCL; with NCCL, set each rank's CUDA
            device first: the plan travels by object collectives).
        external_tag: the tag of every key, or ``key -> tag``.
        alignment: bytes, of every entry (upstream's ``add_named_data`` alignment).
        segment_alignment: bytes (the ``FlatTensorSerializer``'s, 128).
        chunk_nbytes: piece size in bytes for reading and writing.
        progress: as :func:`ptdstream.save`, for the bytes this rank writes:
            ``True`` for a tqdm bar on its stderr, a callable taking the bytes of
            each piece, or ``False`` / ``None``; any other value fails the first
            step on every rank (its ``ArgumentTypeError`` named per rank).

    Returns:
        A :class:`DistributedReport` on every rank.

    Raises:
        DistributedWriteError: on every rank, when any rank failed, naming the
            step and each failed rank with its error; nothing is published and
            the temp files are removed. Only when the group itself fails while
            rank 0 publishes can the set be published: ``published`` says so
            on rank 0 (``None``, unknown, on the others).
        DistributedIntegrityError: (a ``DistributedWriteError`` and an
            ``IntegrityError``) on every rank, when the failed ranks refused a
            piece that changed after hand-over, naming rank, key, file and offset.
    """
    start = time.perf_counter()
    steps = Collective(group)
    folder = os.path.abspath(os.fspath(folder))
    tag_of = external_tag if callable(external_tag) else (lambda key: external_tag)
    save = _RankWrite(tensors, folder, tag_of, alignment, steps.rank, segment_alignment, chunk_nbytes, progress)
    try:
        all_infos = steps.all_gather("describe the pieces", save.describe)
        all_partials = steps.all_gather("fingerprint the dedup candidates", lambda: save.fingerprint(all_infos))
        wire, dedup = steps.broadcast("plan the files", lambda: save.plan(all_partials))
        written = steps.all_gather("write the pieces", lambda: save.write(wire))[steps.rank]
        try:
            published = steps.broadcast("publish", lambda: save.publish(wire))
        except DistributedWriteError as e:
            if e.group_error is None:
                raise
            # The group failed while rank 0 published: rank 0 knows whether it had.
            raise DistributedWriteError(e.step, {}, e.group_error, save.published if steps.rank == 0 else None) from e
    except BaseException:
        save.abort()
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
