"""What the ExecuTorch runtime checks when it loads a program and its methods.

``verify`` promises: exit 0 means ``Runtime.get().load_program(pte, data_path=ptd)``
and ``load_method`` of every method succeed (with ``--loader module``: the C++ ``Module``
given the .ptd files, merged; :mod:`ptdstream.check.runtime.load`). Each rule below names the upstream
function it mirrors (executorch 1.5.1 C++ runtime; read at pytorch/executorch
``cff6f4dd32``, the newest snapshot available, version.txt 1.5.0+). Where the runtime
would read through a null pointer or abort (``ET_CHECK``, ``Result::get()`` of an
error), the rule refuses too: a crash is not a load.

Program load (``runtime/executor/program.cpp::Program::load``), in order (the installed
1.5.1 runtime also refuses a Program ``version`` above 0, and is built with
``ET_ENABLE_DEPRECATED_CONSTANT_BUFFER=0``, so a program without constant segment
offsets is refused; both found by the differential test, newer than the snapshot read):

1. the first 64 bytes load (``ExtendedHeader::kNumHeadBytes``; ``MmapDataLoader::load``
   refuses a range past the end), ``schema/extended_header.cpp::ExtendedHeader::Parse``
   (magic ``eh00``, length >= 24), file size >= ``segment_base_offset +
   segment_data_size`` (or ``program_size``), identifier ``ET12``, program size >= 8;
2. ``flatbuffers::Verifier`` (``VerifyProgramBuffer``, depth 64, 1,000,000 tables):
   :mod:`ptdstream.format.verifier`;
3. ``program_validation.cpp::validate_program``: ``execution_plan`` and every plan's
   ``values`` present; every Tensor value passes ``validate_tensor`` (sizes present and
   >= 0, valid ScalarType (0..29 except 30 Undefined), numel and nbytes without
   overflow) unless it is a dynamic-shape input; every TensorList has items, each an
   in-range index of a Tensor value;
4. ``pte_data_map.cpp::PteDataMap::create``: ``named_data`` needs ``segments``;
5. constant segment (``offsets`` longer than 1): no ``constant_buffer`` items, ``segments``
   present, ``segment_index`` in range, the segment inside the file (loaded here).

Python binding (``extension/pybindings/pybindings.cpp::PyProgram``): every plan has a
name (``Program::get_method_name``) valid as UTF-8 (pybind11 turns it into a ``str``)
and a ``method_meta`` (``Program::method_meta``:
name, ``non_const_buffer_sizes``, ``inputs``, ``outputs`` present), planned buffer sizes
>= 0 (``MethodMeta::memory_planned_buffer_size``); buffer ``j`` is allocated once with
the largest size any method asks (here: at most ``max_planned_nbytes`` in all).

Method load (``runtime/executor/method.cpp::Method::init``) of each method name (the first
plan of that name, ``get_execution_plan``), in order:

6. ``get_num_external_constants``: a value is Null or has its union table;
7. ``parse_external_constants``: an EXTERNAL tensor without ``allocation_info`` has a
   ``fully_qualified_name``; a .ptd is given; the key is in it
   (``flat_tensor_data_map.cpp::get_named_data``: first entry of that key, segment index
   in range, segment ``offset + size <= segment_base_offset + segment_data_size``), its
   ``tensor_layout`` is present (read unchecked upstream) and valid
   (``tensor_layout.cpp::TensorLayout::create``), it equals the program tensor's
   (``tensor_parser_exec_aten.cpp::validateTensorLayout``) and its data lies in the file;
8. ``parse_values``: IntList items in range; Bool/Double lists and String present;
   Tensor (``tensor_parser_portable.cpp::parseTensor``): storage_offset 0, valid
   ScalarType, not DYNAMIC_UNBOUND, sizes and dim_order present, rank <= 16,
   ``len(dim_order) == rank``, sizes >= 0, dim_order a permutation
   (``dim_order_util.h::validate_dim_order``); its data (``getTensorDataPtr``): EXTERNAL
   mutable tensors through the .ptd, constants through ``get_constant_buffer_data``
   (index < number of constant offsets and ``offset + nbytes <= segment size``, or the
   deprecated ``constant_buffer`` storage), memory-planned tensors through
   ``HierarchicalAllocator::get_offset_address`` (``memory_id - 1`` < buffers,
   ``offset + nbytes <=`` buffer size) and, with initial data,
   ``Program::load_mutable_subsegment_into`` (segments, ``mutable_data_segments[0]``,
   offset index, ``offset + nbytes <=`` segment size, inside the file); TensorList /
   OptionalTensorList items index Tensors (or Null, or -1) parsed earlier; other union
   types refused;
9. delegates present; each (``BackendDelegate::Init``): ``id`` present and, when a backend
   list is given, registered; ``processed`` present, INLINE data index in range or
   SEGMENT index in range of a program with segments and inside the file; every compile
   spec has key and value;
10. chains present and non-empty; every chain has instructions; each instruction's
    arguments are present and of a known type; KernelCall/DelegateCall args in range;
    JumpFalse/Move/Free value indices in range; ``resolve_operator``: operator index in
    range, name present, ``name[.overload]`` shorter than 100 bytes and, when an operator
    list is given, registered.

XNNPACK delegates (``backends/xnnpack/runtime/XNNCompiler.cpp::compileModel``,
``XNNHeader.cpp::XNNHeader::Parse``): :mod:`ptdstream.check.runtime.xnnpack_blob`.

Deliberately stricter than the runtime (refused here, loaded there): a KernelCall whose
operator index or name is invalid when a later KernelCall resolves (``Method::init``
keeps only the last ``resolve_operator`` error, so an earlier one is lost); a .ptd
``dim_order`` longer or shorter than its ``sizes`` (``create_tensor_layout`` reads
``len(sizes)`` entries whatever the vector holds).

Not mirrored: what a backend's ``init`` checks inside its own blob (XNNPACK builds its
graph there), and kernels registered for some dtypes only (``get_op_function_from_registry``
matches by name here). Registration is checked against ``operators``/``backends``;
``check_structure`` passes those of executorch's Python runtime by default
(:mod:`ptdstream.check.runtime.registry`); None leaves it unchecked, and the report says so.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ...format.fb_roots import shown, union_tensor
from ...format.flat_tensor_fb.FlatTensor import FlatTensor
from ...format.program_fb.KernelTypes import KernelTypes as KT
from ...format.program_fb.Program import Program
from .errors import RuleError

__all__ = [
    "HEAD_NBYTES",
    "OPERATOR_NAME_LIMIT",
    "TENSOR_DIMENSION_LIMIT",
    "ProgramFile",
    "PtdMap",
    "check_program",
    "default_planned_limit",
    "in_file",
    "list_items",
    "need",
    "numbers",
    "ptd_entry",
    "ptd_key",
    "tensor_nbytes",
    "valid_type",
]

HEAD_NBYTES = 64
#: ``Program::load`` of executorch 1.5.1 refuses a Program.version above this.
MAX_PROGRAM_VERSION = 0
TENSOR_DIMENSION_LIMIT = 16
OPERATOR_NAME_LIMIT = 100  # kTempBufferSizeForName, including the NUL
#: ``elementSize`` of ScalarType 0..29 (``runtime/core/portable_type/scalar_type.h``).
ELEMENT_SIZE = (1, 1, 2, 4, 8, 2, 4, 8, 4, 8, 16, 1, 1, 1, 4, 2, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 2, 4, 8)
_U64 = (1 << 64) - 1
_SSIZE_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class PtdMap:
    """A .ptd as the runtime's ``FlatTensorDataMap`` sees it: its FlatTensor root (verified),
    ``segment_base_offset``/``segment_data_size`` from its header, and its size in bytes.
    ``found``: the keys the rules' lookups (:func:`ptd_key`) found in it so far, in order
    (which data files a program needs: :mod:`ptdstream.check.runtime.load`)."""

    path: str
    root: FlatTensor
    segment_base_offset: int
    segment_data_nbytes: int
    file_nbytes: int
    found: dict[bytes, None] = dataclasses.field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class ProgramFile:
    """A .pte as ``Program::load`` sees it: the verified Program root, the extended header's
    ``segment_base_offset`` (0 without header) and the file size in bytes."""

    path: str
    root: Program
    segment_base_offset: int
    file_nbytes: int


def need(ok: bool, rule: str, detail: str) -> None:
    """Raise :class:`RuleError` naming ``rule`` (the runtime check, its upstream file) and ``detail`` unless ``ok``."""
    if not ok:
        raise RuleError(rule, detail)


def _items(length: int, get) -> Iterator:
    for i in range(length):
        yield get(i)


def numbers(obj, name: str) -> tuple[int, ...] | None:
    """The vector field ``name`` of a flatc table ``obj`` as a tuple, None when the field is absent."""
    if getattr(obj, f"{name}IsNone")():
        return None
    get = getattr(obj, name)
    return tuple(get(j) for j in range(getattr(obj, f"{name}Length")()))


def tensor_nbytes(scalar_type: int, sizes: Sequence[int]) -> int | None:
    """numel * elementSize, None when it overflows size_t (``validate_tensor``)."""
    n = 1
    for s in sizes:
        n *= s
        if n > _SSIZE_MAX:
            return None
    nbytes = n * ELEMENT_SIZE[scalar_type]
    return nbytes if nbytes <= _U64 else None


def valid_type(t: int) -> bool:
    """Whether ``t`` is a ScalarType the runtime knows (one with an element size)."""
    return 0 <= t < len(ELEMENT_SIZE)


# -- program load ---------------------------------------------------------------------------

def check_program(pte: ProgramFile, max_planned_nbytes: int) -> dict:
    """Program::load + validate_program + the Python binding's method metas.

    Returns ``{"methods": {method name: index of its first plan}, "planned": [bytes of
    each planned buffer the binding allocates]}`` once every check passed.

    Raises:
        RuleError: the first rule the program breaks.
    """
    p = pte.root
    need(pte.file_nbytes >= HEAD_NBYTES, "Program::load (ExtendedHeader::kNumHeadBytes)",
          f"file is {pte.file_nbytes} bytes; the runtime loads the first {HEAD_NBYTES}")
    need(p.Version() <= MAX_PROGRAM_VERSION, "Program::load (schema version)",
          f"Program schema version {p.Version()} is newer than the highest the runtime supports "
          f"({MAX_PROGRAM_VERSION})")
    need(not p.ExecutionPlanIsNone(), "program_validation.cpp::validate_program", "Program has null execution_plan")
    plans = list(_items(p.ExecutionPlanLength(), p.ExecutionPlan))
    for i, plan in enumerate(plans):
        _validate_plan(i, plan)
    need(p.NamedDataIsNone() or not p.SegmentsIsNone(), "PteDataMap::create", "named_data without segments")
    cs = p.ConstantSegment()
    need(cs is not None and cs.OffsetsLength() > 0, "Program::load (ET_ENABLE_DEPRECATED_CONSTANT_BUFFER=0)",
          "no constant_segment offsets: the deprecated constant_buffer path is disabled in the runtime")
    if cs.OffsetsLength() > 1:
        need(p.ConstantBufferLength() == 0, "Program::load",
              f"constant_buffer has {p.ConstantBufferLength()} items and constant_segment.offsets "
              f"{cs.OffsetsLength()}; only one may be used")
        need(not p.SegmentsIsNone(), "Program::load", "constant segment but no segments in program")
        need(cs.SegmentIndex() < p.SegmentsLength(), "Program::load",
              f"constant segment index {cs.SegmentIndex()} >= {p.SegmentsLength()} segments")
        seg = p.Segments(cs.SegmentIndex())
        in_file(pte.segment_base_offset + seg.Offset(), seg.Size(), pte.file_nbytes, "Program::load",
                 f"constant segment {cs.SegmentIndex()}")
    methods: dict[str, int] = {}
    planned: dict[int, int] = {}
    for i, plan in enumerate(plans):
        need(plan.Name() is not None, "Program::get_method_name", f"execution plan {i} has null name")
        raw = plan.Name().split(b"\0", 1)[0]
        try:  # the Python binding returns method names as str (pybind11 decodes UTF-8 strictly)
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RuleError("PyProgram::get_method_name (UTF-8)",
                            f"execution plan {i} name {raw!r} is not UTF-8") from None
        if name in methods:
            continue
        methods[name] = i
        for field in ("NonConstBufferSizes", "Inputs", "Outputs"):
            need(not getattr(plan, f"{field}IsNone")(), "Program::method_meta",
                  f"method {name!r}: missing {_snake(field)} field")
        sizes = numbers(plan, "NonConstBufferSizes") or ()  # present: checked just above
        for j, size in enumerate(sizes[1:]):
            need(size >= 0, "MethodMeta::memory_planned_buffer_size",
                  f"method {name!r}: planned buffer {j} has negative size {size}")
            planned[j] = max(planned.get(j, 0), size)
    total = sum(planned.values())
    need(total <= max_planned_nbytes, "PyProgram (planned buffer allocation)",
          f"planned buffers need {total:,} bytes, more than the limit {max_planned_nbytes:,}")
    return {"methods": methods, "planned": [planned[j] for j in sorted(planned)]}


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


def in_file(offset: int, nbytes: int, file_nbytes: int, rule: str, what: str) -> None:
    """Require ``[offset, offset + nbytes)`` (bytes) to lie inside a file of ``file_nbytes`` bytes (:func:`need`)."""
    need(offset <= _U64 and offset + nbytes <= file_nbytes, rule,
          f"{what} [{offset}, {offset + nbytes}) runs past the end of the file ({file_nbytes} bytes)")


def _validate_plan(i: int, plan) -> None:
    rule = "program_validation.cpp::validate_program"
    need(not plan.ValuesIsNone(), rule, f"execution plan {i} has null values table")
    n = plan.ValuesLength()
    inputs = set(numbers(plan, "Inputs") or ())
    for k in range(n):
        v = plan.Values(k)
        kind = v.ValType()
        if kind == KT.Tensor:
            need(v.Val() is not None, rule, f"plan {i} value {k}: Tensor is null")
            t = union_tensor(v)
            problem = _tensor_problem(t)
            if problem and not (k in inputs and t.ShapeDynamism() != 0):
                raise RuleError(rule, f"plan {i} value {k}: {problem}")
        elif kind == KT.TensorList:
            need(v.Val() is not None, rule, f"plan {i} value {k}: TensorList is null")
            items = list_items(v)
            if items is None:
                raise RuleError(rule, f"plan {i} value {k}: TensorList items is null")
            for j, idx in enumerate(items):
                need(0 <= idx < n, rule,
                     f"plan {i} value {k}: TensorList item {j} index {idx} out of range ({n} values)")
                need(plan.Values(idx).ValType() == KT.Tensor, rule,
                      f"plan {i} value {k}: TensorList item {j} references a non-Tensor value {idx}")


def _tensor_problem(t) -> str | None:
    sizes = numbers(t, "Sizes")
    if sizes is None:
        return "Tensor has null sizes"
    if any(s < 0 for s in sizes):
        return f"negative size in {list(sizes)}"
    if not valid_type(t.ScalarType()):
        return f"invalid ScalarType {t.ScalarType()}"
    if tensor_nbytes(t.ScalarType(), sizes) is None:
        return f"sizes {list(sizes)} overflow"
    return None


def list_items(value) -> tuple[int, ...] | None:
    """The items of an ``EValue`` holding a ``*List`` table (ints, doubles or bools by its type), None when absent."""
    from ...format.program_fb.IntList import IntList  # same layout for every *List table: items at slot 4

    tab = value.Val()
    lst = IntList()
    lst.Init(tab.Bytes, tab.Pos)
    if lst.ItemsIsNone():
        return None
    width = {KT.IntList: 8, KT.DoubleList: 8, KT.BoolList: 1}.get(value.ValType(), 4)
    o = lst._tab.Offset(4)
    start, count = lst._tab.Vector(o), lst._tab.VectorLen(o)
    fmt = {8: "q", 1: "B", 4: "i"}[width]
    return struct.unpack_from(f"<{count}{fmt}", tab.Bytes, start)


def runtime_key(name):
    """The key the runtime looks an external tensor up by, given the program's
    ``fully_qualified_name`` (bytes or str): the flatbuffer string read as a C
    string, cut at its first NUL (``tensor_parser_exec_aten.cpp`` passes
    ``fully_qualified_name()->c_str()`` to ``NamedDataMap::get_data`` /
    ``get_tensor_layout``). The .ptd key it is compared with is taken whole
    (executorch 1.5.1 refuses a .ptd key ``"w\\0x"`` for a name ``"w"``)."""
    return name.split(b"\0" if isinstance(name, bytes) else "\0", 1)[0]


def ptd_entry(ptds: Sequence[PtdMap], key: bytes, where: str):
    """(.ptd, entry) of the first entry of ``key`` for a tensor of the program
    (``get_tensor_layout``/``load_data_into``: the entry needs a tensor_layout)."""
    for ptd in ptds:
        entry = ptd_key(ptd, key, need_layout=True)
        if entry is not None:
            return ptd, entry
    names = ", ".join(p.path for p in ptds)
    raise RuleError("flat_tensor_data_map.cpp::get_named_data",
                    f"{where}: key {shown(key, True)} is not in {names}")


def ptd_key(ptd: PtdMap, key: bytes, need_layout: bool = False):
    """``get_named_data``: the first entry of ``key`` in ``ptd`` (None if absent), its
    segment checked. ``need_layout``: the lookup is ``get_tensor_layout``'s, which
    reads the entry's tensor_layout (``get_data``, a backend's lookup, does not)."""
    rule = "flat_tensor_data_map.cpp::get_named_data"
    root = ptd.root
    for i in range(root.NamedDataLength()):
        e = root.NamedData(i)
        if e.Key() != key:
            continue
        idx = e.SegmentIndex()
        need(idx < root.SegmentsLength(), rule, f"{ptd.path}: key {shown(key, True)} names "
              f"segment {idx} of {root.SegmentsLength()}")
        seg = root.Segments(idx)
        end = seg.Offset() + seg.Size()
        need(end <= _U64 and end <= ptd.segment_base_offset + ptd.segment_data_nbytes, rule,
              f"{ptd.path}: key {shown(key, True)}: segment end {end} beyond segment data")
        need(not need_layout or e.TensorLayout() is not None, "flat_tensor_data_map.cpp::get_tensor_layout",
              f"{ptd.path}: key {shown(key, True)} has no tensor_layout")
        ptd.found[key] = None
        return e
    return None


def default_planned_limit() -> int:
    """Bytes of physical memory: the runtime's binding allocates (and zeroes) every planned
    buffer at load, so more than this cannot load here."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40
