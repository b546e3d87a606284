"""This rank's pieces, taken at hand-over (steps 1 and 2 of
:mod:`ptdstream.distributed.protocol`): each key's piece described as a
:class:`~ptdstream.distributed.global_plan.PieceInfo` and held as a source carrying the
fingerprint it is checked against when written; a dedup candidate's composable
digest, checked against that fingerprint in the same pass.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import IntegrityError, LayoutError
from ..sources import BufferRing, Source, as_source
from ..sources.fingerprint import StreamingDigest
from .composable_fingerprint import digest_piece
from .global_plan import PREFIX_NBYTES, PieceInfo, check_local_shape, store_layout

__all__ = ["candidate_digest", "local_pieces"]


def local_pieces(tensors: Mapping[str, Any], tag_of: Callable[[str], str], alignment: int, rank: int):
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
    :mod:`ptdstream.hooks.cuda.keeping` does). ``fingerprint=False`` for a copy the
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


def candidate_digest(source: Source, offset: int, ring: BufferRing):
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
