"""Bounds-checked reader of a .ptd's FlatTensor flatbuffer (``flat_tensor.fbs``).

Used by :mod:`ptdstream.reader`; split out to keep each module to one job.
"""

from __future__ import annotations

import struct
from typing import List, Optional, Tuple

from flatbuffers import number_types as N
from flatbuffers.table import Table

from .errors import FormatError
from .reader import NamedEntry, TensorLayout, _fail

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
        return _fail(self.name, pos, f"FlatTensor flatbuffer: {what}")

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
                layout = TensorLayout(self.scalar(lt, 4, N.Int8Flags, "scalar_type"),
                                      self.numbers(lt, 6, "i", "sizes"), self.numbers(lt, 8, "B", "dim_order"))
            named.append(NamedEntry(key, self.scalar(e, 6, N.Uint32Flags, f"{what}.segment_index"), layout))
        return self.scalar(root, 4, N.Uint32Flags, "version"), spans, named
