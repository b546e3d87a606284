"""The Python flatbuffer verifier accepts what flatbuffers::Verifier (v24.3.25) accepts and
refuses the rest, naming the offset; shared offsets cost linear work."""

from __future__ import annotations

import struct
import time

import flatbuffers
import pytest

from ptdstream.errors import FlatbufferError
from ptdstream.format.fb_roots import program_root
from ptdstream.format.program_fb import DataSegment as DS
from ptdstream.format.program_fb import Program as P
from ptdstream.format.verifier import verify_buffer


def _program(version: int = 0, segment=(64, 128), name: bytes = b"") -> bytes:
    """A Program with one DataSegment (two u64 fields) and, when ``name``, a NamedData key."""
    from ptdstream.format.program_fb import NamedData as ND

    b = flatbuffers.Builder(0)
    named = None
    if name:
        key = b.CreateString(name.decode())
        ND.NamedDataStart(b)
        ND.NamedDataAddKey(b, key)
        nd = ND.NamedDataEnd(b)
        P.ProgramStartNamedDataVector(b, 1)
        b.PrependUOffsetTRelative(nd)
        named = b.EndVector()
    DS.DataSegmentStart(b)
    DS.DataSegmentAddOffset(b, segment[0])
    DS.DataSegmentAddSize(b, segment[1])
    seg = DS.DataSegmentEnd(b)
    P.ProgramStartSegmentsVector(b, 1)
    b.PrependUOffsetTRelative(seg)
    segs = b.EndVector()
    P.ProgramStart(b)
    P.ProgramAddVersion(b, version)
    P.ProgramAddSegments(b, segs)
    if named is not None:
        P.ProgramAddNamedData(b, named)
    b.Finish(P.ProgramEnd(b), file_identifier=b"ET12")
    return bytes(b.Output())


def _field_pos(buf: bytes, getter) -> int:
    root = program_root(buf)
    return getter(root)


def test_a_valid_program_passes_and_reads_back():
    buf = _program(segment=(64, 128))
    verify_buffer(buf, "program")
    seg = program_root(buf).Segments(0)
    assert (seg.Offset(), seg.Size()) == (64, 128)


def test_identifier_and_minimum_size():
    buf = _program()
    with pytest.raises(FlatbufferError, match=r"file identifier b'ET13' != expected b'ET12'"):
        verify_buffer(buf[:4] + b"ET13" + buf[8:], "program")
    with pytest.raises(FlatbufferError, match="below the flatbuffers minimum 12"):
        verify_buffer(buf[:8], "program")


def test_root_offset_zero_misaligned_or_past_the_end():
    buf = bytearray(_program())
    for value, message in ((0, "is 0 or >= 2\\*\\*31"), (1 << 31, "is 0 or >= 2\\*\\*31"), (len(buf), "lies outside")):
        bad = bytearray(buf)
        bad[0:4] = struct.pack("<I", value)
        with pytest.raises(FlatbufferError, match=message):
            verify_buffer(bytes(bad), "program")
    bad = bytearray(buf)
    bad[0:4] = struct.pack("<I", struct.unpack_from("<I", buf, 0)[0] + 2)  # a table at a 2-aligned spot
    with pytest.raises(FlatbufferError, match="not 4-byte aligned"):
        verify_buffer(bytes(bad), "program")


def test_a_u64_field_must_be_8_byte_aligned():
    buf = bytearray(_program())
    seg = program_root(bytes(buf)).Segments(0)
    vtable = seg._tab.Pos - struct.unpack_from("<i", buf, seg._tab.Pos)[0]
    off = struct.unpack_from("<H", buf, vtable + 4)[0]  # DataSegment.offset slot
    buf[vtable + 4 : vtable + 6] = struct.pack("<H", off + 4)  # still inside the table, now 4 mod 8
    with pytest.raises(FlatbufferError, match=r"Program.segments\[0\].offset at \d+ is not 8-byte aligned"):
        verify_buffer(bytes(buf), "program")


def test_vtable_size_must_be_even_and_inside():
    buf = bytearray(_program())
    root = struct.unpack_from("<I", buf, 0)[0]
    vtable = root - struct.unpack_from("<i", buf, root)[0]
    for vsize, message in ((7, "vtable size 7 is odd"), (0xFFFE, "vtable \\(65534 bytes")):
        bad = bytearray(buf)
        bad[vtable : vtable + 2] = struct.pack("<H", vsize)
        with pytest.raises(FlatbufferError, match=message):
            verify_buffer(bytes(bad), "program")


def test_a_short_vtable_means_absent_fields():
    """vsize 4 (no field slots) is valid: every field reads as absent, as in C++."""
    buf = bytearray(_program())
    root = struct.unpack_from("<I", buf, 0)[0]
    vtable = root - struct.unpack_from("<i", buf, root)[0]
    buf[vtable : vtable + 2] = struct.pack("<H", 4)
    verify_buffer(bytes(buf), "program")
    assert program_root(bytes(buf)).SegmentsIsNone()


def test_strings_need_their_nul_terminator_inside_the_buffer():
    buf = bytearray(_program(name=b"weights"))
    at = bytes(buf).index(b"weights")
    assert buf[at + 7] == 0
    buf[at + 7] = ord("!")
    with pytest.raises(FlatbufferError, match=r"named_data\[0\].key \(7 bytes\) is not NUL-terminated"):
        verify_buffer(bytes(buf), "program")
    length = at - 4
    buf[at + 7] = 0
    buf[length : length + 4] = struct.pack("<I", len(buf))
    with pytest.raises(FlatbufferError, match="lies outside the buffer"):
        verify_buffer(bytes(buf), "program")


def test_shared_offsets_count_table_visits_in_linear_work():
    """30,000 plans sharing one values vector of 30,000 shared EValues: 9e8 table visits
    for the C++ verifier (over its 1,000,000 limit); refused here in well under a second
    of memoized work."""
    from ptdstream.format.program_fb import EValue as EV
    from ptdstream.format.program_fb import ExecutionPlan as EP
    from ptdstream.format.program_fb import Int

    fanout = 30_000
    b = flatbuffers.Builder(0)
    Int.IntStart(b)
    Int.IntAddIntVal(b, 7)
    iv = Int.IntEnd(b)
    EV.EValueStart(b)
    EV.EValueAddValType(b, 2)
    EV.EValueAddVal(b, iv)
    ev = EV.EValueEnd(b)
    EP.ExecutionPlanStartValuesVector(b, fanout)
    for _ in range(fanout):
        b.PrependUOffsetTRelative(ev)
    values = b.EndVector()
    EP.ExecutionPlanStart(b)
    EP.ExecutionPlanAddValues(b, values)
    plan = EP.ExecutionPlanEnd(b)
    P.ProgramStartExecutionPlanVector(b, fanout)
    for _ in range(fanout):
        b.PrependUOffsetTRelative(plan)
    plans = b.EndVector()
    P.ProgramStart(b)
    P.ProgramAddExecutionPlan(b, plans)
    b.Finish(P.ProgramEnd(b), file_identifier=b"ET12")
    start = time.process_time()  # CPU seconds: the work done, not the machine's load
    with pytest.raises(FlatbufferError, match="more than 1,000,000 table visits"):
        verify_buffer(bytes(b.Output()), "program")
    assert time.process_time() - start < 2.0
