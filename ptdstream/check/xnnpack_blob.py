"""What the XNNPACK backend's ``init`` checks in its delegate blob before building a graph.

Mirrors ``backends/xnnpack/runtime/XNNHeader.cpp::XNNHeader::Parse`` and the start of
``XNNCompiler.cpp::XNNCompiler::compileModel``:

* a blob shorter than 30 bytes (``XNNHeader::kMinSize``) is refused; with magic ``XH00`` at
  byte 4 the header gives ``flatbuffer_offset`` (u32 at 10), ``flatbuffer_size`` (u32 at 14,
  >= 8), ``constant_data_offset`` (u32 at 18), ``constant_data_size`` (u64 at 22), each
  region inside the blob; without the magic the whole blob is the flatbuffer;
* the flatbuffer identifier is ``XN00`` or ``XN01``; ``flatbuffers::Verifier`` accepts it
  as an ``XNNGraph`` (no identifier check, default limits); ``xvalues`` and ``xnodes``
  are present; ``num_externs <= 4096``;
* every ``ConstantDataOffset`` but the first (``buffer_idx`` 0 means no constant) with a
  ``named_key`` resolves through the method's named
  data map (``Method::init``: the .ptd's ``FlatTensorDataMap`` first, then the program's
  ``PteDataMap``): ``PteDataMap::get_data`` refuses a null key met before the match, a
  segment index out of range, or data past the end of the file. Entries without a key
  lie inside the blob's constant data.

Not mirrored: the graph itself (node and value semantics checked by XNNPACK while it
defines the subgraph).
"""

from __future__ import annotations

import struct
from typing import Callable, Sequence

from ..format.fb_tables import SCHEMAS
from ..format.verifier import FlatbufferError, verify_buffer
from .runtime_rules import PtdMap, ProgramFile, RuleError, in_file, need, ptd_key

MIN_SIZE = 30
MAX_EXTERNS = 4096
_RULE = "XNNCompiler::compileModel"


def _slot(type_name: str, field: str) -> int:
    for name, slot, *_ in SCHEMAS["xnnpack"]["objects"][type_name][3]:
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
    fb_off, fb_size = 0, nbytes
    if head[4:8] == b"XH00":
        fb_off, fb_size, cd_off = struct.unpack_from("<III", head, 10)
        cd_size = struct.unpack_from("<Q", head, 22)[0]
        need(fb_size >= 8, rule, f"{what}: flatbuffer_size {fb_size} is too small")
        need(fb_off <= nbytes and fb_size <= nbytes - fb_off, rule,
             f"{what}: flatbuffer [{fb_off}, +{fb_size}) outside the {nbytes}-byte blob")
        need(cd_off <= nbytes and cd_size <= nbytes - cd_off, rule,
             f"{what}: constant data [{cd_off}, +{cd_size}) outside the {nbytes}-byte blob")
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
    pos = _table(fb, root, _slot(graph, "constant_data"))
    if pos is None:
        return
    vec = _deref(fb, pos)
    key_slot = _slot("fb_xnnpack.ConstantDataOffset", "named_key")
    for i in range(1, struct.unpack_from("<I", fb, vec)[0]):  # buffer_idx 0 means "no constant"
        entry = _deref(fb, vec + 4 + 4 * i)
        kpos = _table(fb, entry, key_slot)
        if kpos is None:
            continue
        s = _deref(fb, kpos)
        key = fb[s + 4 : s + 4 + struct.unpack_from("<I", fb, s)[0]]
        _resolve(key.split(b"\0", 1)[0], f"{what}: constant {i}", pte, ptds)


def _resolve(key: bytes, what: str, pte: ProgramFile, ptds: Sequence[PtdMap]) -> None:
    for ptd in ptds:
        if ptd_key(ptd, key) is not None:
            return
    p = pte.root
    rule = "PteDataMap::get_data"
    need(not p.NamedDataIsNone() or ptds, "Method::init", f"{what}: no named data map for key {key!r}")
    for i in range(p.NamedDataLength()):
        entry = p.NamedData(i)
        need(entry.Key() is not None, rule, f"{what}: searching for {key!r}: named data {i} has no key")
        if entry.Key() != key:
            continue
        idx = entry.SegmentIndex()
        need(idx < p.SegmentsLength(), rule, f"{what}: key {key!r} names segment {idx} of {p.SegmentsLength()}")
        seg = p.Segments(idx)
        in_file(pte.segment_base_offset + seg.Offset(), seg.Size(), pte.file_nbytes, rule, f"{what}: data of {key!r}")
        return
    raise RuleError(rule, f"{what}: key {key!r} is not in the program's or the .ptd files' named data")
