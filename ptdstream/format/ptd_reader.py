"""Read a .ptd's metadata: the FlatTensor header and flatbuffer (``flat_tensor.fbs``).

:class:`FlatTensorReader` is a bounds-checked reader over
``flatbuffers.table.Table``: every offset and vector length is checked before it
is used and the total work is capped at a few times the flatbuffer's size.
Segment payload is never read.
"""

from __future__ import annotations

import struct
from typing import Dict, List, Optional, Tuple

from flatbuffers import number_types as N
from flatbuffers.table import Table

from ..errors import FormatError
from .artifact import Artifact, NamedEntry, ReadAt, TensorMeta, check_index, fail, label, segments_of
from .identity import FlatTensorHeader


class FlatTensorReader:
    """Bounds-checked reader of ``flat_tensor.fbs``'s ``FlatTensor`` over
    ``flatbuffers.table.Table``. Slots (``4 + 2 * field id``): FlatTensor{version 4,
    segments 6, named_data 8}, DataSegment{offset 4, size 6}, NamedData{key 4,
    segment_index 6, tensor_layout 8}, TensorLayout{scalar_type 4, sizes 6,
    dim_order 8}. Every position is checked before it is read; work is capped at
    ``4 * len(buf)`` bytes, so offsets shared by a corrupt file cannot blow up."""

    def __init__(self, buf: bytes, name: str) -> None:
        self.buf, self.name, self.budget = buf, name, 4 * len(buf) + 4096

    def fail(self, pos: int, what: str) -> FormatError:
        return fail(self.name, pos, f"FlatTensor flatbuffer: {what}")

    def u32(self, pos: int, what: str, width: int = 4, fmt: str = "<I") -> int:
        if pos < 0 or pos + width > len(self.buf):
            raise self.fail(pos, f"{what} ({width} bytes) lies outside the flatbuffer ({len(self.buf)} bytes)")
        return struct.unpack_from(fmt, self.buf, pos)[0]

    def spend(self, nbytes: int, pos: int) -> None:
        self.budget -= nbytes
        if self.budget < 0:
            raise self.fail(pos, "offsets reference more data than the flatbuffer holds")

    def table(self, pos: int, what: str) -> Tuple[Table, int]:
        vtable = pos - self.u32(pos, what, fmt="<i")
        vsize, tsize = self.u32(vtable, f"{what} vtable", 2, "<H"), self.u32(vtable + 2, f"{what} vtable", 2, "<H")
        if vsize < 4 or vsize % 2:
            raise self.fail(vtable, f"{what} vtable size {vsize} is invalid")
        self.u32(vtable, f"{what} vtable", vsize, "<H")
        self.u32(pos, what, max(tsize, 4))
        self.spend(vsize + tsize, pos)
        return Table(self.buf, pos), tsize

    def field(self, tab: Tuple[Table, int], slot: int, width: int, what: str) -> Optional[int]:
        off = tab[0].Offset(slot)  # the vtable was checked in table()
        if off and off + width > tab[1]:
            raise self.fail(tab[0].Pos + off, f"{what} lies outside its table ({tab[1]} bytes)")
        return tab[0].Pos + off if off else None

    def scalar(self, tab, slot: int, flags, what: str):
        pos = self.field(tab, slot, flags.bytewidth, what)
        return 0 if pos is None else tab[0].Get(flags, pos)

    def indirect(self, pos: int, what: str) -> int:
        return pos + self.u32(pos, what)

    def vector(self, tab, slot: int, width: int, what: str) -> Optional[Tuple[int, int]]:
        pos = self.field(tab, slot, 4, what)
        if pos is None:
            return None
        start = self.indirect(pos, what)
        count = self.u32(start, f"{what} length")
        if count * width > len(self.buf) - start - 4:
            raise self.fail(start, f"{what} claims {count} elements of {width} bytes, beyond the flatbuffer's end")
        self.spend(4 + count * width, start)
        return start + 4, count

    def numbers(self, tab, slot: int, fmt: str, what: str) -> Tuple[int, ...]:
        vec = self.vector(tab, slot, struct.calcsize(fmt), what)
        return () if vec is None else struct.unpack_from(f"<{vec[1]}{fmt}", self.buf, vec[0])

    def tables(self, tab, slot: int, what: str) -> Optional[List[Tuple[Table, int]]]:
        vec = self.vector(tab, slot, 4, what)
        if vec is None:
            return None
        return [self.table(self.indirect(vec[0] + 4 * i, what), f"{what}[{i}]") for i in range(vec[1])]

    def read(self) -> Tuple[int, List[Tuple[int, int]], List[NamedEntry]]:
        root = self.table(self.indirect(0, "root offset"), "FlatTensor")
        segs, entries = self.tables(root, 6, "segments"), self.tables(root, 8, "named_data")
        if segs is None or entries is None:
            raise self.fail(root[0].Pos, "segments or named_data is missing (the runtime requires both)")
        spans = [(self.scalar(s, 4, N.Uint64Flags, "offset"), self.scalar(s, 6, N.Uint64Flags, "size")) for s in segs]
        named = []
        for i, e in enumerate(entries):
            what = f"named_data[{i}]"
            if self.field(e, 4, 4, f"{what}.key") is None:
                raise self.fail(e[0].Pos, f"{what} has no key")
            try:
                key = bytes(self.numbers(e, 4, "B", f"{what}.key")).decode("utf-8")
            except UnicodeDecodeError:
                raise self.fail(e[0].Pos, f"{what}.key is not UTF-8") from None
            layout, lpos = None, self.field(e, 8, 4, f"{what}.tensor_layout")
            if lpos is not None:
                lt = self.table(self.indirect(lpos, f"{what}.tensor_layout"), f"{what}.tensor_layout")
                layout = TensorMeta(self.scalar(lt, 4, N.Int8Flags, "scalar_type"),
                                      self.numbers(lt, 6, "i", "sizes"), self.numbers(lt, 8, "B", "dim_order"))
            named.append(NamedEntry(key, self.scalar(e, 6, N.Uint32Flags, f"{what}.segment_index"), layout))
        return self.scalar(root, 4, N.Uint32Flags, "version"), spans, named


def parse_ptd(name: str, nbytes: int, head: bytes, read_at: ReadAt) -> Artifact:
    header = FlatTensorHeader.from_bytes(head[8 : 8 + FlatTensorHeader.LENGTH])
    if header is None:
        raise fail(name, 8, f"no FlatTensor header: expected b'FH01' with length >= {FlatTensorHeader.LENGTH}, "
                    f"found {head[8:12]!r}" + (" (file truncated)" if nbytes < 48 else ""))
    fb_off, fb_size = header.flatbuffer_offset, header.flatbuffer_size
    base, data_nbytes = header.segment_base_offset, header.segment_data_size
    if not header.length <= fb_off <= nbytes:
        raise fail(name, 16, f"flatbuffer_offset {fb_off} is outside [{header.length}, file size {nbytes}]")
    if not 8 <= fb_size <= nbytes - fb_off:
        raise fail(name, 24, f"flatbuffer_size {fb_size} is below 8 or runs beyond the end of the file ({nbytes} bytes)")
    fb_end = fb_off + fb_size
    if not fb_end <= base <= nbytes:
        raise fail(name, 32, f"segment_base_offset {base} is outside [{fb_end}, file size {nbytes}]")
    if data_nbytes > nbytes - base:
        raise fail(name, 40, f"segment_data_size {data_nbytes}: segments [{base}, {base + data_nbytes}) "
                    f"end beyond the end of the file ({nbytes} bytes)")
    version, spans, named = FlatTensorReader(read_at(0, fb_end), name).read()
    labels: Dict[int, List] = {}
    for entry in named:
        check_index(name, base, spans, entry.segment_index, f"named data {entry.key!r}")
        label(labels, entry.segment_index, "named data", entry.key)
    segments = segments_of(name, base, spans, labels, base + data_nbytes, True)
    return Artifact(
        path=name, kind="ptd", file_nbytes=nbytes, identifier=head[4:8].decode("ascii"), header=header,
        flatbuffer_end=fb_end, segment_base_offset=base, segment_data_nbytes=data_nbytes,
        segments=segments, named=tuple(named), version=version,
    )
