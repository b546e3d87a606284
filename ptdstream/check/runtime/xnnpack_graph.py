"""What ``XNNCompiler::compileModel`` checks in an XNNPACK graph, decided from the flatbuffer.

Runs after :mod:`ptdstream.check.runtime.xnnpack_blob` (header, verification, constant data) on the
same verified flatbuffer, and mirrors ``backends/xnnpack/runtime/XNNCompiler.cpp``:

* ``defineTensor``: ``dq_datatype`` is ``xnn_datatype_invalid`` (or a value ``getDataType``
  maps to it), or ``qint8`` on an EXTERNAL_INPUT value ("Only int8_t is supported for
  dq_datatype"); a quantized value's parameters are of a type it handles; a plain
  tensor's ``datatype`` is one ``xnn_define_tensor_value`` takes (fp32, fp16, int32,
  pfp32, bf16), a quantized one's is not invalid; ``dims`` has at most ``XNN_MAX_TENSOR_DIMS`` (6)
  entries; an ``external_id`` other than ``XNN_INVALID_VALUE_ID`` is below
  ``num_externs`` (``xnn_define_*tensor_value``); an external input or output value has one;
* ``getDefineNodeFunc``: every node's union type is one the compiler defines (not NONE,
  not ``XNNScaledDotProductAttention``, not past the union), with its table present;
* ``REMAP_ID``: every value id a node reads or writes (its ``*_id`` fields; for
  ``ConcatenateN`` the first N inputs) is the ``id_out`` of a defined value, or
  ``XNN_INVALID_VALUE_ID``;
* ``xnn_subgraph_check_output_min_max``: a node with ``output_min_max`` that passes it to
  XNNPACK has ``output_min < output_max`` (neither NaN; an absent field is the schema's
  default, 0.0, as the serializer leaves out a ReLU's ``output_min``);
* ``xnn_create_runtime_v4`` packs the constant tensors: their bytes by dims and datatype,
  in all, fit in physical memory (else ``xnn_status_out_of_memory``).

Not mirrored: what ``xnn_define_*`` and ``xnn_create_runtime_v4`` check of shapes and
datatypes across a node's values (at load the runtime does not compare a fully connected
node's filter with its bias, input or output: shapes meet at the first execute).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from ...format.fb_tables import SCHEMAS
from .rules import default_planned_limit, need

__all__ = ["check_xnnpack_graph", "tensor_nbytes"]

INVALID_ID = 0xFFFFFFFF
MAX_DIMS = 6  # XNN_MAX_TENSOR_DIMS
EXTERNAL = 0x1 | 0x2
DT_QINT8 = 3
PLAIN_DATATYPES = {1, 2, 12, 13, 14}  # fp32, fp16, int32, pfp32, bf16
KNOWN_DATATYPES = set(range(1, 15))  # getDataType's cases; others map to invalid
# bits per element of each datatype (fp32 fp16 qint8 quint8 qint32 qcint8 qcint32 qcint4 qdint8
# qbint4 qpint8 int32 pfp32 bf16)
BITS = dict(zip(range(1, 15), (32, 16, 8, 8, 32, 8, 32, 4, 8, 4, 8, 32, 32, 16), strict=True))
_XNNPACK: Mapping[str, Any] = SCHEMAS["xnnpack"]  # the generated tables: nested dicts and tuples
QUANT_PARAMS = set(_XNNPACK["unions"]["fb_xnnpack.XNNQuantParams"])
SDPA = 36  # XNNScaledDotProductAttention: in the union, not in getDefineNodeFunc
# nodes whose define passes output_min_max to xnn_subgraph_check_output_min_max: FullyConnected,
# Clamp, Conv2d, AvgPooling2d, DepthwiseConv2d, MaxPooling2d, GlobalAvgPooling2d, ConvTranspose2d
MIN_MAX_NODES = {2, 6, 7, 11, 13, 14, 19, 39}
CAT_INPUTS = {32: 2, 33: 3, 34: 4, 38: 5}  # XNNConcatenate2/3/4/5
_OBJECTS = _XNNPACK["objects"]
_NODE_TABLES: dict[int, str] = _XNNPACK["unions"]["fb_xnnpack.XNodeUnion"]
_VALUE_RULE = "XNNCompiler.cpp::defineTensor"
_NODE_RULE = "XNNCompiler.cpp::getDefineNodeFunc"
_REMAP_RULE = "XNNCompiler.cpp::REMAP_ID"


def _slot(type_name: str, field: str) -> int:
    for name, slot, *_ in _OBJECTS[type_name][3]:
        if name == field:
            return slot
    raise KeyError(field)


def _field(fb: bytes, pos: int, type_name: str, field: str):
    """Position of ``field`` in the (verified) table at ``pos``, or None."""
    vtable = pos - struct.unpack_from("<i", fb, pos)[0]
    vsize = struct.unpack_from("<H", fb, vtable)[0]
    slot = _slot(type_name, field)
    off = struct.unpack_from("<H", fb, vtable + slot)[0] if slot < vsize else 0
    return pos + off if off else None


def _scalar(fb: bytes, pos: int, type_name: str, field: str, fmt: str = "<I", default: int = 0) -> int:
    at = _field(fb, pos, type_name, field)
    return struct.unpack_from(fmt, fb, at)[0] if at is not None else default


def _deref(fb: bytes, pos: int) -> int:
    return pos + struct.unpack_from("<I", fb, pos)[0]


def _tables(fb: bytes, root: int, field: str):
    at = _field(fb, root, "fb_xnnpack.XNNGraph", field)
    if at is None:
        return []
    vec = _deref(fb, at)
    return [_deref(fb, vec + 4 + 4 * i) for i in range(struct.unpack_from("<I", fb, vec)[0])]


def check_xnnpack_graph(fb: bytes, root: int, what: str, memory_limit: int | None = None) -> None:
    """Refuse the verified XNNPACK graph at ``root`` of ``fb`` as ``compileModel`` would
    (after the checks of :func:`~ptdstream.check.runtime.xnnpack_blob.check_xnnpack_blob`).

    Raises:
        RuleError: the first check the graph fails (rule names the upstream function).
    """
    externs = _scalar(fb, root, "fb_xnnpack.XNNGraph", "num_externs")
    defined: set[int] = {INVALID_ID}
    constant_nbytes = 0
    for i, xv in enumerate(_tables(fb, root, "xvalues")):
        vid, nbytes = _check_value(fb, xv, externs, f"{what}: xvalue {i}")
        defined.add(vid)
        constant_nbytes += nbytes
    if memory_limit is None:
        memory_limit = default_planned_limit()
    need(constant_nbytes <= memory_limit, "xnn_create_runtime_v4",
         f"{what}: constant tensors of {constant_nbytes:,} bytes (by their dims) exceed the "
         f"{memory_limit:,} bytes of memory XNNPACK packs them into (xnn_status_out_of_memory)")
    for i, node in enumerate(_tables(fb, root, "xnodes")):
        _check_node(fb, node, defined, f"{what}: xnode {i}")


def _check_value(fb: bytes, xv: int, externs: int, where: str) -> tuple[int, int]:
    """Checks one XValue (already known to be a (quantized) tensor value); returns its
    id_out and, for a constant, its bytes by its dims and datatype (else 0)."""
    t = "fb_xnnpack.XNNTensorValue"
    kind = _scalar(fb, xv, "fb_xnnpack.XValue", "xvalue_union_type", "<B")
    tv = _deref(fb, _field(fb, xv, "fb_xnnpack.XValue", "xvalue_union"))
    quantized = kind == 2
    if quantized:
        q = "fb_xnnpack.XNNQuantizedTensorValue"
        params = _scalar(fb, tv, q, "quant_params_type", "<B")
        need(params in QUANT_PARAMS and _field(fb, tv, q, "quant_params") is not None, _VALUE_RULE,
             f"{where}: unhandled quantization parameters {params}")
        tv = _deref(fb, _field(fb, tv, q, "tensor_value"))
    flags = _scalar(fb, tv, t, "flags")
    dq = _scalar(fb, tv, t, "dq_datatype", "<h")
    if dq in KNOWN_DATATYPES:
        need(dq == DT_QINT8, _VALUE_RULE, f"{where}: dq_datatype {dq}: only int8_t is supported")
        need(bool(flags & 0x1), _VALUE_RULE, f"{where}: dynamic quantization of a value that is not an external input")
    datatype = _scalar(fb, tv, t, "datatype", "<h")
    if quantized or dq in KNOWN_DATATYPES:
        need(datatype in KNOWN_DATATYPES, _VALUE_RULE, f"{where}: datatype {datatype} is invalid")
    else:
        need(datatype in PLAIN_DATATYPES, _VALUE_RULE,
             f"{where}: datatype {datatype} is not one xnn_define_tensor_value takes")
    dims = _field(fb, tv, t, "dims")
    vec = _deref(fb, dims) if dims is not None else None
    ndims = struct.unpack_from("<I", fb, vec)[0] if vec is not None else 0
    need(ndims <= MAX_DIMS, _VALUE_RULE, f"{where}: {ndims} dims > XNN_MAX_TENSOR_DIMS ({MAX_DIMS})")
    ext = _scalar(fb, tv, t, "external_id", default=0)
    need(ext == INVALID_ID or ext < externs, _VALUE_RULE, f"{where}: external_id {ext} >= num_externs {externs}")
    need(not flags & EXTERNAL or ext != INVALID_ID, _VALUE_RULE, f"{where}: external value without an external_id")
    nbytes = tensor_nbytes(fb, tv) if _scalar(fb, tv, t, "constant_buffer_idx") else 0
    return _scalar(fb, tv, t, "id_out"), nbytes


def tensor_nbytes(fb: bytes, tv: int) -> int:
    """Bytes of the (verified) XNNTensorValue at ``tv`` by its dims and datatype."""
    t = "fb_xnnpack.XNNTensorValue"
    dims = _field(fb, tv, t, "dims")
    count = 1
    if dims is not None:
        vec = _deref(fb, dims)
        for d in struct.unpack_from(f"<{struct.unpack_from('<I', fb, vec)[0]}I", fb, vec + 4):
            count *= d
    return (count * BITS.get(_scalar(fb, tv, t, "datatype", "<h"), 8) + 7) // 8


def _check_node(fb: bytes, node: int, defined: set[int], where: str) -> None:
    kind = _scalar(fb, node, "fb_xnnpack.XNode", "xnode_union_type", "<B")
    need(kind in _NODE_TABLES and kind != SDPA, _NODE_RULE, f"{where}: unhandled node type {kind}")
    at = _field(fb, node, "fb_xnnpack.XNode", "xnode_union")
    need(at is not None, _NODE_RULE, f"{where}: node of type {kind} has no table")
    table = _NODE_TABLES[kind]
    body = _deref(fb, at)
    ids = [name for name, *_ in _OBJECTS[table][3] if name.endswith("_id")]
    if kind in CAT_INPUTS:
        ids = [f"input{k + 1}_id" for k in range(CAT_INPUTS[kind])] + ["output_id"]
    for name in ids:
        vid = _scalar(fb, body, table, name)
        need(vid in defined, _REMAP_RULE, f"{where}: {name} {vid} is not a defined value")
    mm = _field(fb, node, "fb_xnnpack.XNode", "output_min_max")
    if kind in MIN_MAX_NODES and mm is not None:
        mm = _deref(fb, mm)
        lo = _scalar(fb, mm, "fb_xnnpack.OutputMinMax", "output_min", "<f", 0)
        hi = _scalar(fb, mm, "fb_xnnpack.OutputMinMax", "output_max", "<f", 0)
        need(lo < hi, "xnn_subgraph_check_output_min_max", f"{where}: output range [{lo}, {hi}] is empty or NaN")
