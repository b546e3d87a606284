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
   composable fingerprint (:mod:`ptdstream.distributed.composable_fingerprint`), checking
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..defaults import CHUNK_NBYTES
from ..progress import check_progress, progress_callback
from ..reports import Report
from ..sources import BufferRing, Source
from .collective import Collective
from .composable_fingerprint import combine
from .errors import DistributedIntegrityError, DistributedWriteError
from .global_plan import PieceInfo, collate, dedup_candidates, plan_files, wire_plan
from .local import candidate_digest, local_pieces
from .temp_files import create_temp_files, write_pieces

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
        lines.append(f"{self.rank_nbytes:,} bytes written by this rank; the call took {self.seconds:.2f} s (every "
                     f"rank's descriptions gathered, the plan, the writes, the publish); dedup saved "
                     f"{self.dedup_saved_nbytes:,} bytes")
        return "\n".join(lines)


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
        infos, self.local = local_pieces(self.tensors, self.tag_of, self.alignment, self.rank)
        return infos

    def fingerprint(self, all_infos: list[list[PieceInfo]]) -> dict[str, Any]:
        self.order, self.pieces, self.offsets = collate(all_infos)
        self.heads, self.candidates = dedup_candidates(self.order, self.pieces)
        ring = BufferRing(self.chunk_nbytes, count=1)
        return {key: candidate_digest(self.local[key][0], self.offsets[(key, self.rank)], ring)
                for key in self.order if key in self.candidates and key in self.local}

    def plan(self, all_partials: list[dict[str, Any]]):
        """Rank 0: ``(wire plan, bytes saved by dedup)``."""
        fingerprints = {key: combine(self.pieces[key][0].total_nbytes, [p[key] for p in all_partials if key in p])
                        for key in self.candidates}
        self.files, dedup = plan_files(self.order, self.pieces, self.heads, fingerprints, self.segment_alignment,
                                       self.folder)
        self.sinks = create_temp_files(self.files)
        return wire_plan(self.files, self.sinks), dedup

    def write(self, wire) -> int:
        mine = sum(self.local[key][0].nbytes for _, _, _, writes in wire for key, _, _ in writes if key in self.local)
        with contextlib.ExitStack() as stack:
            update = progress_callback(stack, self.progress, mine, f"rank {self.rank}: writing its pieces")
            written = write_pieces(wire, self.local, self.offsets, self.rank, self.chunk_nbytes, update)
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
