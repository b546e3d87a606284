"""The plan of a distributed write, from what every rank sent: the global key order,
each key's pieces and their offsets, the dedup candidates, the ``.ptd`` plans
(rank 0, with ptdstream's store and planner over :class:`PlannedSource` objects that
know only sizes, first bytes and fingerprints) and the write list each rank
receives."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import LayoutError
from ..sources import BufferRing, Source
from ..sources.fingerprint import Fingerprint

__all__ = ["PREFIX_NBYTES", "PieceInfo", "check_local_shape", "collate", "dedup_candidates", "plan_files",
           "store_layout", "wire_plan"]

PREFIX_NBYTES = 32


@dataclass(frozen=True)
class PieceInfo:
    """One rank's piece of one key (sent to every rank)."""

    key: str
    tag: str
    alignment: int
    scalar_type: int
    sizes: tuple[int, ...]
    dim_order: tuple[int, ...]
    total_nbytes: int
    coordinate: int  # order of the piece among the key's pieces
    sharded: bool  # a DTensor shard (the key is on every rank)
    nbytes: int
    head: bytes  # first min(32, nbytes) bytes of the piece
    rank: int
    placement: str = ""  # "Shard(0)" or "Replicate()" of a DTensor; "" for a plain tensor


#: The attributes every rank's piece of one key must agree on, with their names in errors.
_SAME = (("tag", "external tag"), ("alignment", "alignment"), ("placement", "placement"),
         ("scalar_type", "dtype"), ("sizes", "shape"), ("dim_order", "dim order"))


def check_local_shape(key: str, local: tuple[int, ...], whole: tuple[int, ...], shard: bool, mesh_size: int,
                      coordinate: int) -> None:
    """A DTensor's local tensor has the shape its placement gives its mesh
    coordinate: the whole's for ``Replicate``; for ``Shard(0)`` the whole's with
    the rows ``torch.chunk`` gives the coordinate (DTensor's own rule,
    ``Shard.local_shard_size_and_offset`` of ``torch/distributed/tensor/placement_types.py``).

    Raises:
        LayoutError: another shape (one built with ``DTensor.from_local(...,
            run_check=False, shape=...)``), naming the key, both shapes and the coordinate.
    """
    expected = whole
    if shard:
        from torch.distributed.tensor import Shard

        rows = int(Shard.local_shard_size_and_offset(whole[0], mesh_size, coordinate)[0])
        expected = (rows, *whole[1:])
    if tuple(local) != tuple(expected):
        what = f"Shard(0) over {mesh_size} ranks gives coordinate {coordinate}" if shard else "Replicate() gives"
        raise LayoutError(f"key {key!r}: the local tensor has shape {list(local)}; the whole {list(whole)} "
                          f"placed {what} shape {list(expected)}; pass the local tensor of that shape")


def store_layout(key: str, tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """``(scalar type, sizes, dim order)`` as the single-process store takes them
    (executorch's ``TensorLayout.from_tensor``: contiguous or channels_last only).

    Raises:
        LayoutError: another layout, naming the key.
    """
    from executorch.exir.tensor_layout import TensorLayout

    try:
        layout = TensorLayout.from_tensor(tensor)
    except ValueError as e:
        raise LayoutError(f"key {key!r}: {e}") from None
    return (int(layout.scalar_type), tuple(int(s) for s in layout.sizes),
            tuple(int(d) for d in layout.dim_order))


def _shown(field: str, value):
    if field == "scalar_type":
        from executorch.exir.scalar_type import ScalarType

        return ScalarType(value).name
    return list(value) if isinstance(value, tuple) else repr(value) if isinstance(value, str) else value


class PlannedSource(Source):
    """A buffer known to the planner by size, first bytes and fingerprint only;
    its bytes stay on the ranks that hold them."""

    #: Its bytes are on the ranks, not here: nothing to digest at hand-over.
    is_mutable = False

    def __init__(self, key: str, nbytes: int, head: bytes, fingerprint: Fingerprint | None) -> None:
        self.key = key
        self.nbytes = nbytes
        self._head = head
        self.fingerprint = fingerprint

    def describe(self) -> str:
        return f"key {self.key!r} (held by the ranks)"

    def prefix(self, nbytes: int = 32) -> bytes:
        return self._head[:nbytes]

    def same_content(self, other: Source) -> bool | None:
        if isinstance(other, PlannedSource) and self.fingerprint is not None and other.fingerprint is not None:
            return self.fingerprint == other.fingerprint
        return None

    def pieces(self, ring: BufferRing) -> Iterator[memoryview]:
        raise LayoutError(f"{self.describe()}: its bytes are written by the ranks, not read here")


def collate(all_infos: list[list[PieceInfo]]):
    """Global key order and ``{key: [pieces in order]}`` with their offsets.

    Raises:
        LayoutError: a plain tensor key on two ranks; a DTensor key whose ranks
            disagree on its tag, alignment, placement, dtype, shape or dim order
            (naming both ranks and their values); pieces that do not add up.
    """
    order: list[str] = []
    pieces: dict[str, list[PieceInfo]] = {}
    for infos in all_infos:
        for info in infos:
            if info.key not in pieces:
                order.append(info.key)
                pieces[info.key] = []
            pieces[info.key].append(info)
    offsets: dict[tuple[str, int], int] = {}
    for key, group in pieces.items():
        if len(group) > 1 and not all(p.sharded for p in group):
            raise LayoutError(f"key {key!r} is held by ranks {[p.rank for p in group]}; a key that is not a "
                              "DTensor must be on one rank")
        for field, what in _SAME:
            odd = next((p for p in group if getattr(p, field) != getattr(group[0], field)), None)
            if odd is not None:
                first, theirs = _shown(field, getattr(group[0], field)), _shown(field, getattr(odd, field))
                raise LayoutError(f"key {key!r}: rank {group[0].rank} passes {what} {first}, rank {odd.rank} "
                                  f"{theirs}; every rank must pass the same {what} for a DTensor key")
        group.sort(key=lambda p: (p.coordinate, p.rank))
        end = 0
        for p in group:
            offsets[(key, p.rank)] = end
            end += p.nbytes
        if end != group[0].total_nbytes:
            raise LayoutError(f"key {key!r}: the pieces hold {end} bytes, the tensor {group[0].total_nbytes}")
    return order, pieces, offsets


def dedup_candidates(order: list[str], pieces: dict[str, list[PieceInfo]]):
    """``({key: first 32 bytes}, {keys whose (size, first bytes) another key shares})``."""
    heads = {}
    seen: dict[tuple[int, bytes], int] = {}
    for key in order:
        head = b"".join(p.head for p in pieces[key])[:PREFIX_NBYTES]
        heads[key] = head
        ckey = (pieces[key][0].total_nbytes, head)
        seen[ckey] = seen.get(ckey, 0) + 1
    return heads, {k for k in order if seen[(pieces[k][0].total_nbytes, heads[k])] > 1}


def plan_files(order, pieces, heads, fingerprints, segment_alignment, folder):
    """Rank 0: the ``.ptd`` plans, as ``[(target, FilePlan)]`` and the dedup savings."""
    from executorch.exir.scalar_type import ScalarType
    from executorch.exir.tensor_layout import TensorLayout

    from ..format.ptd import plan_data_files
    from ..store import StreamingNamedDataStore

    store = StreamingNamedDataStore()
    for key in order:
        first = pieces[key][0]
        source = PlannedSource(key, first.total_nbytes, heads[key], fingerprints.get(key))
        layout = TensorLayout(ScalarType(first.scalar_type), list(first.sizes), list(first.dim_order))
        store.add_named_data(key, source, first.alignment, external_tag=first.tag, tensor_layout=layout)
    out = store.get_named_data_store_output()
    files = plan_data_files(out.buffers, out.external_data, folder, segment_alignment=segment_alignment,
                            fingerprints=out.fingerprints)
    return [(f.path, f.plan) for f in files], store.dedup_saved_nbytes


def wire_plan(files, sinks) -> list[tuple[str, str, int, list[tuple[str, int, int]]]]:
    """``[(target, temp path, size, [(key, file offset, bytes)])]`` for every rank."""
    from ..format.plan import ExtentKind

    out = []
    for (target, plan), sink in zip(files, sinks, strict=True):
        writes, offset = [], 0
        for extent in plan.extents:
            if extent.kind is ExtentKind.SOURCE:
                writes.append((extent.source.key, offset, extent.nbytes))
            offset += extent.nbytes
        out.append((target, sink.temp_path, plan.nbytes, writes))
    return out
