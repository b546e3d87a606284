"""What the XNNPACK backend's ``init`` checks in its delegate blob before building a graph.

Mirrors ``backends/xnnpack/runtime/XNNHeader.cpp::XNNHeader::Parse`` and the start of
``XNNCompiler.cpp::XNNCompiler::compileModel``:

* a blob shorter than 30 bytes (``XNNHeader::kMinSize``) is refused; with magic ``XH00`` at
  byte 4 the header gives ``flatbuffer_offset`` (u32 at 10), ``flatbuffer_size`` (u32 at 14,
  >= 8), ``constant_data_offset`` (u32 at 18), ``constant_data_size`` (u64 at 22), each
  region inside the blob, the constant data after the flatbuffer; without the magic the
  whole blob is the flatbuffer;
* the flatbuffer identifier is ``XN00`` or ``XN01``; ``flatbuffers::Verifier`` accepts it
  as an ``XNNGraph`` (no identifier check, default limits); ``xvalues`` and ``xnodes``
  are present; ``num_externs <= 4096``;
* ``defineTensor``: every XValue is an ``XNNTensorValue`` or ``XNNQuantizedTensorValue``
  (with its ``tensor_value``), with no flag but EXTERNAL_INPUT/EXTERNAL_OUTPUT (0x1, 0x2);
  ``getConstantDataPtr``: a non-zero ``constant_buffer_idx`` is in range of
  ``constant_data`` (of ``constant_buffer`` without a header), and an entry without a key
  lies in the blob's constant data region, while one with a ``named_key`` resolves through the method's named
  data map (``Method::init``: the .ptd's ``FlatTensorDataMap`` first, then the program's
  ``PteDataMap``): ``PteDataMap::get_data`` refuses a null key met before the match, a
  segment index out of range, or data past the end of the file. Entries without a key
  lie inside the blob's constant data. The runtime reads as many bytes as the value's
  dims and datatype need (it does not check): they are within the data found.

The graph itself (node types, value ids, datatypes): :mod:`ptdstream.check.runtime.xnnpack_graph`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...errors import FlatbufferError
from ...format.fb_tables import SCHEMAS
from ...format.verifier import verify_buffer
from .errors import RuleError
from .rules import ProgramFile, PtdMap, in_file, need, ptd_key
from .xnnpack_graph import check_xnnpack_graph, tensor_nbytes

__all__ = ["check_xnnpack_blob"]

MIN_SIZE = 30
MAX_EXTERNS = 4096
XNN_TENSOR_VALUE, XNN_QUANTIZED_TENSOR_VALUE = 1, 2  # XValueUnion
ALLOWED_FLAGS = 0x1 | 0x2  # XNN_VALUE_FLAG_EXTERNAL_INPUT | XNN_VALUE_FLAG_EXTERNAL_OUTPUT
_RULE = "XNNCompiler::compileModel"
_XNNPACK: Mapping[str, Any] = SCHEMAS["xnnpack"]  # the generated tables: nested dicts and tuples


def _slot(type_name: str, field: str) -> int:
    for name, slot, *_ in _XNNPACK["objects"][type_name][3]:
        if name == field:
            return slot
    raise KeyError(field)


def _table(buf: bytes, pos: int, vt_slot: int):
    """Position of field ``vt_slot`` of the (verified) table at ``pos``, or None."""
    vtable = pos - struct.unpack_from("<i", buf, pos)[0]
    vsize = struct.unpack_from("<H", buf, vtable)[0]
    off = struct.unpack_from("<H", buf, vtable + vt_slot)[0] if vt_slot < vsize else 0
    return pos + off if off else None


def _deref(buf: bytes, pos: int) -> int:
    return pos + struct.unpack_from("<I", buf, pos)[0]


def check_xnnpack_blob(read_blob: Callable[[int, int], bytes], nbytes: int, what: str, pte: ProgramFile,
                       ptds: Sequence[PtdMap]) -> None:
    """Refuse an XnnpackBackend delegate's processed data as XNNPACK's init would.

    ``read_blob(offset, count)`` reads ``count`` bytes at ``offset`` of the ``nbytes``-byte
    blob; only the 30-byte header and the flatbuffer are read, never the constant data.

    Raises:
        RuleError: the first check the blob fails (rule names the upstream function).
    """
    rule = "XNNHeader::Parse"
    need(nbytes >= MIN_SIZE, rule, f"{what}: blob of {nbytes} bytes is below {MIN_SIZE}")
    head = read_blob(0, MIN_SIZE)
    fb_off, fb_size, cd_size = 0, nbytes, 0
    if head[4:8] == b"XH00":
        fb_off, fb_size, cd_off = struct.unpack_from("<III", head, 10)
        cd_size = struct.unpack_from("<Q", head, 22)[0]
        need(fb_size >= 8, rule, f"{what}: flatbuffer_size {fb_size} is too small")
        need(fb_off <= nbytes and fb_size <= nbytes - fb_off, rule,
             f"{what}: flatbuffer [{fb_off}, +{fb_size}) outside the {nbytes}-byte blob")
        need(cd_off <= nbytes and cd_size <= nbytes - cd_off, rule,
             f"{what}: constant data [{cd_off}, +{cd_size}) outside the {nbytes}-byte blob")
        need(cd_off >= fb_off and cd_off - fb_off >= fb_size, rule,
             f"{what}: constant data at {cd_off} overlaps the flatbuffer [{fb_off}, +{fb_size})")
    fb = read_blob(fb_off, fb_size)
    need(fb[4:8] in (b"XN00", b"XN01"), _RULE, f"{what}: identifier {bytes(fb[4:8])!r} is not XN00 or XN01")
    try:
        verify_buffer(fb, "xnnpack", identifier=b"")
    except FlatbufferError as e:
        raise RuleError(_RULE, f"{what}: XNNPACK flatbuffer fails verification: {e}") from None
    root = _deref(fb, 0)
    graph = "fb_xnnpack.XNNGraph"
    for field in ("xvalues", "xnodes"):
        need(_table(fb, root, _slot(graph, field)) is not None, _RULE, f"{what}: XNNPACK graph has no {field}")
    pos = _table(fb, root, _slot(graph, "num_externs"))
    externs = struct.unpack_from("<I", fb, pos)[0] if pos is not None else 0
    need(externs <= MAX_EXTERNS, _RULE, f"{what}: num_externs {externs} > {MAX_EXTERNS}")
    _check_values(fb, root, head[4:8] == b"XH00", cd_size, what, pte, ptds)
    check_xnnpack_graph(fb, root, what)


def _vector(fb: bytes, pos: int | None) -> tuple[int, int]:
    """(first element position, length) of the (verified) vector whose offset is at ``pos``."""
    if pos is None:
        return 0, 0
    vec = _deref(fb, pos)
    return vec + 4, struct.unpack_from("<I", fb, vec)[0]


def _check_values(fb: bytes, root: int, has_header: bool, cd_size: int, what: str, pte: ProgramFile,
                  ptds: Sequence[PtdMap]) -> None:
    """``defineTensor`` up to ``getConstantDataPtr``: each XValue is a (quantized) tensor
    value with allowed flags, and its constant data resolves."""
    graph, value_t = "fb_xnnpack.XNNGraph", "fb_xnnpack.XNNTensorValue"
    start, count = _vector(fb, _table(fb, root, _slot(graph, "xvalues")))
    data_start, data_count = _vector(fb, _table(fb, root, _slot(graph, "constant_data")))
    has_data = _table(fb, root, _slot(graph, "constant_data")) is not None
    buf_start, buf_count = _vector(fb, _table(fb, root, _slot(graph, "constant_buffer")))
    utype_slot, union_slot = _slot("fb_xnnpack.XValue", "xvalue_union_type"), _slot("fb_xnnpack.XValue", "xvalue_union")
    for i in range(count):
        where = f"{what}: xvalue {i}"
        xv = _deref(fb, start + 4 * i)
        tpos = _table(fb, xv, utype_slot)
        kind = fb[tpos] if tpos is not None else 0
        need(kind in (XNN_TENSOR_VALUE, XNN_QUANTIZED_TENSOR_VALUE), "XNNCompiler.cpp::defineTensor",
             f"{where}: unhandled value type {kind}")
        upos = _table(fb, xv, union_slot)
        need(upos is not None, "XNNCompiler.cpp::defineTensor", f"{where}: deserialized tensor is null")
        tv = _deref(fb, upos)
        if kind == XNN_QUANTIZED_TENSOR_VALUE:
            inner = _table(fb, tv, _slot("fb_xnnpack.XNNQuantizedTensorValue", "tensor_value"))
            need(inner is not None, "XNNCompiler.cpp::defineTensor", f"{where}: deserialized tensor is null")
            tv = _deref(fb, inner)
        fpos = _table(fb, tv, _slot(value_t, "flags"))
        flags = struct.unpack_from("<I", fb, fpos)[0] if fpos is not None else 0
        need(flags & ~ALLOWED_FLAGS == 0, "XNNCompiler.cpp::defineTensor",
             f"{where}: unsupported flag bits 0x{flags:x}")
        ipos = _table(fb, tv, _slot(value_t, "constant_buffer_idx"))
        idx = struct.unpack_from("<I", fb, ipos)[0] if ipos is not None else 0
        if not idx:
            continue
        rule = "XNNCompiler.cpp::getConstantDataPtr"
        if not has_header:
            need(buf_count > idx, rule,
                 f"{where}: buffer_idx {idx} out of bounds for constant_buffer of size {buf_count}")
            entry = _deref(fb, buf_start + 4 * idx)
            storage = _table(fb, entry, _slot("fb_xnnpack.Buffer", "storage"))
            need(storage is not None, rule, f"{where}: null constant_buffer entry at buffer_idx {idx}")
            _fits(fb, tv, _vector(fb, storage)[1], where)
            continue
        need(has_data and idx < data_count, rule,
             f"{where}: buffer_idx {idx} out of bounds for constant_data of size {data_count}")
        entry = _deref(fb, data_start + 4 * idx)
        kpos = _table(fb, entry, _slot("fb_xnnpack.ConstantDataOffset", "named_key"))
        if kpos is None:
            off_pos = _table(fb, entry, _slot("fb_xnnpack.ConstantDataOffset", "offset"))
            size_pos = _table(fb, entry, _slot("fb_xnnpack.ConstantDataOffset", "size"))
            offset = struct.unpack_from("<Q", fb, off_pos)[0] if off_pos is not None else 0
            size = struct.unpack_from("<Q", fb, size_pos)[0] if size_pos is not None else 0
            need(offset <= cd_size and size <= cd_size - offset, rule,
                 f"{where}: constant data [{offset}, +{size}) outside the {cd_size}-byte region")
            _fits(fb, tv, size, where)
            continue
        s = _deref(fb, kpos)
        key = fb[s + 4 : s + 4 + struct.unpack_from("<I", fb, s)[0]]
        _fits(fb, tv, _resolve(key.split(b"\0", 1)[0], f"{where} (constant {idx})", pte, ptds), where)


def _fits(fb: bytes, tv: int, size: int, where: str) -> None:
    """The constant's dims and datatype need no more than its ``size`` bytes of data: XNNPACK
    reads (packs) that many bytes at init, past the data's end otherwise (a crash, or garbage)."""
    want = tensor_nbytes(fb, tv)
    need(want <= size, "XNNCompiler.cpp::defineTensor", f"{where}: dims and datatype need {want} bytes of "
         f"constant data, {size} given")


def _resolve(key: bytes, what: str, pte: ProgramFile, ptds: Sequence[PtdMap]) -> int:
    """Bytes of the data ``key`` names."""
    for ptd in ptds:
        entry = ptd_key(ptd, key)
        if entry is not None:
            return ptd.root.Segments(entry.SegmentIndex()).Size()
    p = pte.root
    rule = "PteDataMap::get_data"
    need(not p.NamedDataIsNone() or bool(ptds), "Method::init", f"{what}: no named data map for key {key!r}")
    for i in range(p.NamedDataLength()):
        entry = p.NamedData(i)
        need(entry.Key() is not None, rule, f"{what}: searching for {key!r}: named data {i} has no key")
        if entry.Key() != key:
            continue
        idx = entry.SegmentIndex()
        need(idx < p.SegmentsLength(), rule, f"{what}: key {key!r} names segment {idx} of {p.SegmentsLength()}")
        seg = p.Segments(idx)
        in_file(pte.segment_base_offset + seg.Offset(), seg.Size(), pte.file_nbytes, rule, f"{what}: data of {key!r}")
        return seg.Size()
    raise RuleError(rule, f"{what}: key {key!r} is not in the program's or the .ptd files' named data")
