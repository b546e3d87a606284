"""Rules 6-10 of :mod:`ptdstream.check.runtime.rules`: what ``Method::init``
(``runtime/executor/method.cpp``) checks when the runtime loads one method.

Values are judged in the runtime's order; a list may only reference values parsed
before it (upstream reads the not-yet-initialized ``EValue`` otherwise, which no
serializer writes), so such a forward reference is refused.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from ...format.fb_roots import union_tensor
from ...format.program_fb.InstructionArguments import InstructionArguments as IA
from ...format.program_fb.KernelTypes import KernelTypes as KT
from ...system.files import open_input
from .errors import RuleError
from .kernels import unregistered_hint
from .rules import (
    OPERATOR_NAME_LIMIT,
    TENSOR_DIMENSION_LIMIT,
    ProgramFile,
    PtdMap,
    in_file,
    list_items,
    need,
    numbers,
    tensor_nbytes,
    valid_type,
)
from .rules import (
    ptd_entry as _ptd_entry,
)

__all__ = ["check_method"]

_EXTERNAL = 1
_DYNAMIC_UNBOUND = 2
_INLINE, _SEGMENT = 0, 1
_U64 = (1 << 64) - 1


def check_method(pte: ProgramFile, plan_index: int, name: str, ptds: Sequence[PtdMap], planned: Sequence[int],
                 operators: Set[str] | None = None, backends: Set[str] | None = None) -> None:
    """Check that ``Program::load_method(name)`` succeeds.

    Args:
        pte: the program (verified root, segment base, file size).
        plan_index: index of the first execution plan named ``name``.
        ptds: the .ptd files given with the program (Python's ``load_program`` takes one;
            with several, a key is looked up in each in order, as a merged data map).
        planned: the planned buffer sizes in bytes the binding allocates (largest per
            index over all methods).
        operators: registered operator names (``name`` or ``name.overload``); None skips
            the registration check.
        backends: registered backend ids; None skips the registration check.

    Raises:
        RuleError: the first rule the method breaks (rule names the upstream function).
    """
    plan = pte.root.ExecutionPlan(plan_index)
    where = f"method {name!r}"
    n = plan.ValuesLength()
    values = [plan.Values(k) for k in range(n)]
    for k, v in enumerate(values):
        need(v.ValType() == KT.Null or v.Val() is not None, "Method::get_num_external_constants",
              f"{where}: null value at index {k}")
    resolved: dict[bytes, bool] = {}
    for k, v in enumerate(values):
        if v.ValType() != KT.Tensor:
            continue
        t = union_tensor(v)
        info = t.ExtraTensorInfo()
        if info is None or info.Location() != _EXTERNAL or t.AllocationInfo() is not None:
            continue
        fqn = info.FullyQualifiedName()
        need(fqn is not None, "Method::parse_external_constants",
              f"{where}: value {k}: fully qualified name of external tensor is null")
        key = fqn.split(b"\0", 1)[0]
        if key in resolved:
            continue
        need(bool(ptds), "Method::parse_external_constants",
              f"{where}: value {k} needs external data {key.decode(errors='replace')!r} and no .ptd is given")
        ptd, entry = _ptd_entry(ptds, key, where)
        _check_layout(t, entry, where, key)
        seg = ptd.root.Segments(entry.SegmentIndex())
        in_file(ptd.segment_base_offset + seg.Offset(), seg.Size(), ptd.file_nbytes,
                 "FlatTensorDataMap::get_data", f"{ptd.path}: data of key {key.decode(errors='replace')!r}")
        resolved[key] = True
    kinds: list[int | None] = [None] * n
    for k, v in enumerate(values):
        _parse_value(pte, plan, ptds, planned, k, v, kinds, where)
        kinds[k] = v.ValType()
    _check_delegates(pte, plan, where, backends, ptds)
    _check_chains(plan, n, where, operators)


def _check_layout(t, entry, where: str, key: bytes) -> int:
    """TensorLayout::create of the .ptd entry, then validateTensorLayout against ``t``.
    Returns the bytes of the .ptd layout (numel * element size)."""
    lt = entry.TensorLayout()
    what = f"{where}: external tensor {key.decode(errors='replace')!r}"
    sizes, order = numbers(lt, "Sizes"), numbers(lt, "DimOrder")
    rule = "tensor_layout.cpp::TensorLayout::create"
    if sizes is None or order is None or len(order) != len(sizes):
        raise RuleError(rule, f"{what}: .ptd layout sizes/dim_order missing or of different lengths")
    layout_nbytes = (tensor_nbytes(lt.ScalarType(), sizes)
                     if valid_type(lt.ScalarType()) and all(s >= 0 for s in sizes) else None)
    if layout_nbytes is None or not all(d < len(sizes) for d in order):
        raise RuleError(rule, f"{what}: .ptd layout {lt.ScalarType()} {list(sizes)} {list(order)} is invalid")
    rule = "tensor_parser_exec_aten.cpp::validateTensorLayout"
    need(t.ScalarType() == lt.ScalarType(), rule, f"{what}: scalar type {t.ScalarType()} != .ptd {lt.ScalarType()}")
    mine, my_order = numbers(t, "Sizes"), numbers(t, "DimOrder")
    if mine is None or my_order is None:
        raise RuleError(rule, f"{what}: missing sizes or dim_order")
    need(mine == sizes and my_order == order, rule,
          f"{what}: sizes {list(mine)} dim_order {list(my_order)} != .ptd {list(sizes)} {list(order)}")
    return layout_nbytes


def _parse_value(pte, plan, ptds, planned, k, v, kinds, where) -> None:
    rule = "Method::parse_values"
    kind = v.ValType()
    what = f"{where}: value {k}"
    n = len(kinds)
    if kind in (KT.Null, KT.Int, KT.Bool, KT.Double):
        return
    if kind == KT.String:
        from ...format.program_fb.String import String

        s = String()
        s.Init(v.Val().Bytes, v.Val().Pos)
        need(s.StringVal() is not None, rule, f"{what}: missing string")
        return
    if kind in (KT.IntList, KT.DoubleList, KT.BoolList, KT.TensorList, KT.OptionalTensorList):
        items = list_items(v)
        if items is None:
            raise RuleError(rule, f"{what}: missing list")
        if kind == KT.IntList:
            for j, idx in enumerate(items):
                need(0 <= idx < n, rule, f"{what}: IntList item {j} index {idx} out of range ({n} values)")
        elif kind == KT.TensorList:
            for j, idx in enumerate(items):
                need(0 <= idx < n and kinds[idx] == KT.Tensor, "tensor_parser_exec_aten.cpp::parseTensorList",
                      f"{what}: TensorList item {j} = {idx} is not a Tensor parsed before it")
        elif kind == KT.OptionalTensorList:
            for j, idx in enumerate(items):
                need(idx == -1 or (0 <= idx < n and kinds[idx] in (KT.Tensor, KT.Null)),
                      "tensor_parser.h::parseListOptionalType",
                      f"{what}: OptionalTensorList item {j} = {idx} is not a Tensor or None parsed before it")
        return
    if kind != KT.Tensor:
        raise RuleError(rule, f"{what}: unknown KernelTypes value {kind}")
    _parse_tensor(pte, plan, ptds, planned, union_tensor(v), what)


def _parse_tensor(pte, plan, ptds, planned, t, what) -> None:
    rule = "tensor_parser_portable.cpp::parseTensor"
    need(t.StorageOffset() == 0, rule, f"{what}: non-zero storage offset {t.StorageOffset()}")
    need(valid_type(t.ScalarType()), rule, f"{what}: invalid ScalarType {t.ScalarType()}")
    need(t.ShapeDynamism() != _DYNAMIC_UNBOUND, rule, f"{what}: fully dynamic shapes are not supported")
    sizes, order = numbers(t, "Sizes"), numbers(t, "DimOrder")
    if sizes is None:
        raise RuleError(rule, f"{what}: missing sizes")
    need(len(sizes) <= TENSOR_DIMENSION_LIMIT, rule, f"{what}: rank {len(sizes)} > {TENSOR_DIMENSION_LIMIT}")
    if order is None or len(order) != len(sizes):
        raise RuleError(rule, f"{what}: dim_order missing or of rank != {len(sizes)}")
    need(all(s >= 0 for s in sizes), rule, f"{what}: negative size in {list(sizes)}")
    need(not sizes or sorted(order) == list(range(len(sizes))), "dim_order_util.h::validate_dim_order",
          f"{what}: dim_order {list(order)} is not a permutation of 0..{len(sizes) - 1}")
    nbytes = tensor_nbytes(t.ScalarType(), sizes)
    if nbytes is None:
        raise RuleError(rule, f"{what}: sizes {list(sizes)} overflow")
    _tensor_data(pte, ptds, planned, t, nbytes, what)


def _planned(planned: Sequence[int], alloc, nbytes: int, what: str) -> None:
    rule = "HierarchicalAllocator::get_offset_address"
    memory_id = (alloc.MemoryId() - 1) & 0xFFFFFFFF
    offset = alloc.MemoryOffsetLow() | (alloc.MemoryOffsetHigh() << 32)
    need(memory_id < len(planned), rule, f"{what}: memory id {alloc.MemoryId()} names no planned buffer "
          f"({len(planned)} buffers)")
    need(offset + nbytes <= min(planned[memory_id], _U64), rule,
          f"{what}: [{offset}, {offset + nbytes}) is outside planned buffer {memory_id} ({planned[memory_id]} bytes)")


def _tensor_data(pte: ProgramFile, ptds, planned, t, nbytes: int, what: str) -> None:
    """getTensorDataPtr."""
    rule = "tensor_parser_exec_aten.cpp::getTensorDataPtr"
    p = pte.root
    idx, alloc, info = t.DataBufferIdx(), t.AllocationInfo(), t.ExtraTensorInfo()
    if info is not None and info.Location() == _EXTERNAL:
        need(info.FullyQualifiedName() is not None, rule, f"{what}: external tensor without name")
        if alloc is None:
            return  # resolved in parse_external_constants
        key = info.FullyQualifiedName().split(b"\0", 1)[0]
        need(bool(ptds), rule, f"{what}: mutable external tensor {key!r} and no .ptd is given")
        ptd, entry = _ptd_entry(ptds, key, what)
        layout_nbytes = _check_layout(t, entry, what, key)
        _planned(planned, alloc, nbytes, what)
        need(nbytes <= layout_nbytes, "FlatTensorDataMap::load_data_into", f"{what}: {nbytes} > layout {layout_nbytes}")
        seg = ptd.root.Segments(entry.SegmentIndex())
        in_file(ptd.segment_base_offset + seg.Offset(), layout_nbytes, ptd.file_nbytes,
                 "FlatTensorDataMap::load_data_into", f"{ptd.path}: data of {key!r}")
        return
    if idx > 0 and alloc is None:
        cs = p.ConstantSegment()
        if cs is not None and cs.OffsetsLength() > 1:
            rule = "Program::get_constant_buffer_data"
            need(idx < cs.OffsetsLength(), rule,
                  f"{what}: constant index {idx} out of range of {cs.OffsetsLength()} constant offsets")
            size = p.Segments(cs.SegmentIndex()).Size()
            offset = cs.Offsets(idx)
            need(offset <= size and nbytes <= size - offset, rule,
                  f"{what}: constant {idx} [{offset}, {offset + nbytes}) runs past the constant segment ({size} bytes)")
            return
        rule = "Program::get_constant_buffer_data (constant_buffer)"
        need(idx < p.ConstantBufferLength(), rule,
              f"{what}: constant buffer index {idx} out of range of {p.ConstantBufferLength()}")
        storage = p.ConstantBuffer(idx).StorageLength()
        need(nbytes <= storage, rule, f"{what}: {nbytes} bytes > constant buffer storage {storage}")
        return
    if alloc is not None:
        _planned(planned, alloc, nbytes, what)
    if idx > 0 and alloc is not None:
        rule = "Program::load_mutable_subsegment_into"
        need(pte.segment_base_offset != 0 and not p.SegmentsIsNone(), rule, f"{what}: no segments in program")
        need(p.MutableDataSegmentsLength() > 0, rule, f"{what}: no mutable data segments in program")
        sub = p.MutableDataSegments(0)
        need(not sub.OffsetsIsNone() and idx < sub.OffsetsLength(), rule,
              f"{what}: mutable data offset index {idx} out of range of {sub.OffsetsLength()}")
        need(sub.SegmentIndex() < p.SegmentsLength(), rule,
              f"{what}: mutable data segment index {sub.SegmentIndex()} >= {p.SegmentsLength()} segments")
        seg = p.Segments(sub.SegmentIndex())
        offset = sub.Offsets(idx)
        need(offset + nbytes <= seg.Size(), rule,
              f"{what}: mutable data [{offset}, {offset + nbytes}) runs past its segment ({seg.Size()} bytes)")
        in_file(pte.segment_base_offset + seg.Offset() + offset, nbytes, pte.file_nbytes, rule, f"{what}: mutable data")


def _check_delegates(pte: ProgramFile, plan, where: str, backends, ptds: Sequence[PtdMap]) -> None:
    from .xnnpack_blob import check_xnnpack_blob

    rule = "BackendDelegate::Init"
    need(not plan.DelegatesIsNone(), "Method::init", f"{where}: missing delegates field")
    p = pte.root
    for i in range(plan.DelegatesLength()):
        d = plan.Delegates(i)
        what = f"{where}: delegate {i}"
        need(d.Id() is not None, rule, f"{what}: missing backend id")
        backend = d.Id().split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        need(backends is None or backend in backends, rule, f"{what}: backend {backend!r} is not registered")
        ref = d.Processed()
        need(ref is not None, rule, f"{what}: missing processed data reference")
        if ref.Location() == _INLINE:
            need(not p.BackendDelegateDataIsNone() and ref.Index() < p.BackendDelegateDataLength(),
                  "Program::get_backend_delegate_data", f"{what}: inline data index {ref.Index()} out of range")
            inline = p.BackendDelegateData(ref.Index())
            data = _vector_bytes(inline, 4)
            blob = (lambda off, n, data=data: data[off : off + n]), len(data)
        elif ref.Location() == _SEGMENT:
            rule2 = "Program::LoadSegment"
            need(pte.segment_base_offset != 0, rule2, f"{what}: the program has no segments")
            need(not p.SegmentsIsNone() and ref.Index() < p.SegmentsLength(), rule2,
                  f"{what}: segment index {ref.Index()} out of range")
            seg = p.Segments(ref.Index())
            in_file(pte.segment_base_offset + seg.Offset(), seg.Size(), pte.file_nbytes, rule2, f"{what}: blob")
            start = pte.segment_base_offset + seg.Offset()
            blob = (lambda off, n, start=start: _read_range(pte.path, start + off, n)), seg.Size()
        else:
            raise RuleError(rule, f"{what}: unknown data location {ref.Location()}")
        for j in range(d.CompileSpecsLength()):
            spec = d.CompileSpecs(j)
            need(spec.Key() is not None and not spec.ValueIsNone(), "BackendDelegate::PopulateCompileSpecs",
                  f"{what}: compile spec {j} lacks key or value")
        if backend == "XnnpackBackend":
            check_xnnpack_blob(*blob, f"{what} ({backend})", pte, ptds)


def _read_range(path: str, offset: int, nbytes: int) -> bytes:
    with open_input(path) as f:
        f.seek(offset)
        return f.read(nbytes)


def _check_chains(plan, n: int, where: str, operators) -> None:
    from ...format.program_fb.FreeCall import FreeCall
    from ...format.program_fb.JumpFalseCall import JumpFalseCall
    from ...format.program_fb.KernelCall import KernelCall
    from ...format.program_fb.MoveCall import MoveCall

    rule = "Method::init (chains)"
    need(not plan.ChainsIsNone() and plan.ChainsLength() > 0, rule, f"{where}: no chains")
    for c in range(plan.ChainsLength()):
        chain = plan.Chains(c)
        need(not chain.InstructionsIsNone(), rule, f"{where}: missing instructions in chain {c}")
        for i in range(chain.InstructionsLength()):
            ins = chain.Instructions(i)
            what = f"{where}: chain {c} instruction {i}"
            args = ins.InstrArgs()
            need(args is not None, rule, f"{what}: null instruction")
            kind = ins.InstrArgsType()
            if kind in (IA.KernelCall, IA.DelegateCall):
                call = KernelCall()  # DelegateCall has the same layout: index at slot 4, args at 6
                call.Init(args.Bytes, args.Pos)
                need(not call.ArgsIsNone(), rule, f"{what}: call args missing")
                for j in range(call.ArgsLength()):
                    a = call.Args(j)
                    need(0 <= a < n, "gen_instruction_arguments", f"{what}: arg {j} index {a} >= {n} values")
                if kind == IA.KernelCall:
                    _check_operator(plan, call.OpIndex(), what, operators)
                continue
            cls = {IA.MoveCall: MoveCall, IA.JumpFalseCall: JumpFalseCall, IA.FreeCall: FreeCall}.get(kind)
            if cls is None:
                raise RuleError(rule, f"{what}: invalid instruction type {kind}")
            call = cls()
            call.Init(args.Bytes, args.Pos)
            indices: tuple[int, ...]
            if kind == IA.MoveCall:
                indices = (call.MoveFrom(), call.MoveTo())
            elif kind == IA.JumpFalseCall:
                indices = (call.CondValueIndex(),)
            else:
                indices = (call.ValueIndex(),)
            for a in indices:
                need(0 <= a < n, rule, f"{what}: value index {a} negative or >= {n}")


def _check_operator(plan, op_index: int, what: str, operators) -> None:
    rule = "Method::resolve_operator"
    need(not plan.OperatorsIsNone() and (op_index & 0xFFFFFFFF) < plan.OperatorsLength(), rule,
          f"{what}: operator index {op_index} out of range")
    op = plan.Operators(op_index)
    need(op.Name() is not None, rule, f"{what}: missing operator name")
    name = op.Name().split(b"\0", 1)[0]
    overload = op.Overload().split(b"\0", 1)[0] if op.Overload() is not None else b""
    full = name + (b"." + overload if op.Overload() is not None and len(op.Overload()) > 0 else b"")
    need(len(full) < OPERATOR_NAME_LIMIT, rule, f"{what}: operator name {full[:40]!r}... is {len(full)} bytes")
    text = full.decode("utf-8", "surrogateescape")
    if operators is not None and text not in operators:
        raise RuleError(rule, f"{what}: operator {text!r} is not registered: {unregistered_hint(text)}")


def _vector_bytes(table, slot: int) -> bytes:
    """The bytes of a (verified) ``[ubyte]`` field of a generated table, b"" when absent."""
    o = table._tab.Offset(slot)
    if not o:
        return b""
    start = table._tab.Vector(o)
    return bytes(table._tab.Bytes[start : start + table._tab.VectorLen(o)])
