"""Every private ExecuTorch name ptdstream relies on, in one place.

Checked against executorch 1.5.1 (:data:`CHECKED_VERSIONS`). ``tests/test_upstream.py``
imports each of them and fails loudly when a release renames or removes one.
Public API (``NamedDataStore``, ``ExecutorchProgramManager``, ``FileBackedData``)
is imported where it is used.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, Optional, Tuple

CHECKED_VERSIONS = ("1.5.1",)


def file_backed_path(data: Any) -> Optional[str]:
    """The path behind an executorch ``FileBackedData`` (private ``_path``), else None."""
    try:
        from executorch.exir._serialize._cord import FileBackedData
    except ImportError:  # pragma: no cover
        return None
    if isinstance(data, FileBackedData):
        return data._path
    return None


def program_to_flatbuffer(program, constant_tensor_alignment, delegate_alignment) -> Tuple[bytes, int]:
    """Upstream's Python-builder flatbuffer for a ``Program`` and its max alignment.

    ``exir/_serialize/_flatbuffer_program.py::_program_to_flatbuffer``: the exact
    builder ``serialize_pte_binary`` uses (flatc gives other bytes).
    """
    from executorch.exir._serialize._flatbuffer_program import _program_to_flatbuffer

    result = _program_to_flatbuffer(
        program,
        constant_tensor_alignment=constant_tensor_alignment,
        delegate_alignment=delegate_alignment,
    )
    return bytes(result.data), result.max_alignment


def flat_tensor_to_flatbuffer(flat_tensor) -> bytes:
    """Upstream's FlatTensor flatbuffer (JSON through the bundled flatc).

    ``extension/flat_tensor/serialize/serialize.py::_serialize_to_flatbuffer``.
    """
    from executorch.extension.flat_tensor.serialize.serialize import _serialize_to_flatbuffer

    return bytes(_serialize_to_flatbuffer(flat_tensor))


def flatbuffer_to_program(data: bytes):
    """Parse a program flatbuffer into ``executorch.exir.schema.Program``."""
    from executorch.exir._serialize._flatbuffer_program import _flatbuffer_to_program

    return _flatbuffer_to_program(data)


def external_tensor_layouts(program) -> Dict[str, Any]:
    """``{fqn: TensorLayout}`` of the program's external tensors, as upstream
    computes them for the emitter's constants
    (``exir/_serialize/_serialize.py::_extract_external_tensor_layouts``)."""
    from executorch.exir._serialize._serialize import _extract_external_tensor_layouts

    return _extract_external_tensor_layouts(program)


def manager_parts(manager) -> Dict[str, Any]:
    """What ``save()`` needs from an ``ExecutorchProgramManager`` (private fields).

    Returns a dict with ``program`` (the emitter's ``Program``, constants still
    inline), ``mutable_data`` (``List[Buffer]`` or None), ``external_constant_buffer``
    (``List[bytes]``), ``external_constant_map`` (``{tag: {fqn: index}}``),
    ``named_data`` (the backends' ``NamedDataStoreOutput`` or None),
    ``ptd_segment_alignment`` (the FlatTensorSerializer's) and ``pte_head``: the
    bytes before the first segment of the manager's own serialized .pte (its
    metadata head, used to read back layout parameters).
    """
    emitter = manager._emitter_output
    pte_cord = manager._pte_data
    head = pte_cord._buffers[0] if pte_cord._buffers else b""
    return {
        "program": emitter.program,
        "mutable_data": emitter.mutable_data,
        "external_constant_buffer": emitter.external_constant_buffer or [],
        "external_constant_map": emitter.external_constant_map or {},
        "named_data": manager._named_data,
        "ptd_segment_alignment": manager._data_serializer.config.segment_alignment,
        "pte_head": bytes(head) if not isinstance(head, bytes) else head,
    }


def reference_cords(manager) -> Tuple[Any, Dict[str, Any]]:
    """The manager's own serialized output: the .pte ``Cord`` and ``{tag: Cord}``."""
    return manager._pte_data, dict(manager._tensor_data or {})


def cord_pieces(cord, chunk_nbytes: int):
    """Yield a ``Cord``'s bytes in pieces without joining them (bounded memory).

    ``FileBackedData`` items (a file, or ptdstream's ``SourceBackedData``) are read
    through :func:`~ptdstream.sources.as_source`; each piece is valid until the
    next one is requested.
    """
    from executorch.exir._serialize._cord import FileBackedData

    from .sources import BufferRing, as_source

    ring = BufferRing(chunk_nbytes, count=2)
    for item in cord._buffers:
        if isinstance(item, FileBackedData):
            yield from as_source(item).pieces(ring)
        else:
            view = memoryview(item)
            for start in range(0, len(view), chunk_nbytes):
                yield view[start : start + chunk_nbytes]


class _BoundedBytes(bytes):
    """``bytes`` whose slices must end inside it. The flatbuffers Python reader
    slices strings and byte vectors without a bounds check, so a program cut
    inside its last string would otherwise parse, with the string shortened."""

    def __getitem__(self, key):
        if isinstance(key, slice) and key.stop is not None and key.stop > len(self):
            raise IndexError(f"bytes [{key.start}:{key.stop}] lie beyond the flatbuffer's {len(self)} bytes")
        return super().__getitem__(key)


class _ObjectBudget:
    """Counts the tables executorch's generated object API unpacks, and raises
    once a program flatbuffer of ``nbytes`` bytes would need more of them than it
    can hold without shared offsets (each table takes at least 4 bytes)."""

    active = None  # the budget of the parse in progress (parses are not concurrent)

    def __init__(self, nbytes: int) -> None:
        self.left = nbytes // 4 + 1024
        self.nbytes = nbytes

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise ValueError(
                f"the program flatbuffer ({self.nbytes} bytes) unpacks into more objects "
                "than it could hold: shared offsets (a crafted file?)"
            )


_BUDGET_INSTALLED = False


def _install_object_budget() -> None:
    """Wrap every generated ``*T.InitFromBuf``/``InitFromObj`` with a budget check."""
    global _BUDGET_INSTALLED
    if _BUDGET_INSTALLED:
        return
    import importlib
    import pkgutil

    from executorch.exir._serialize.generated import executorch_flatbuffer as package

    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        cls = getattr(module, f"{info.name}T", None)
        if cls is None:
            continue
        for name in ("InitFromBuf", "InitFromObj"):
            original = getattr(cls, name, None)
            if original is None:
                continue

            def counted(*args, _original=original):
                if _ObjectBudget.active is not None:
                    _ObjectBudget.active.spend()
                return _original(*args)

            setattr(cls, name, classmethod(lambda c, *a, _f=counted: _f(*a)))
    _BUDGET_INSTALLED = True


def _vector_elements(obj, budget: _ObjectBudget, depth: int = 0) -> None:
    """Spend one unit per element of every list/array in an unpacked tree, so a
    scalar vector shared by many tables cannot expand without bound either."""
    if depth > 64:
        raise ValueError("the program flatbuffer nests deeper than 64 levels")
    for value in vars(obj).values():
        if isinstance(value, (bytes, bytearray, str)) or value is None:
            continue
        if hasattr(value, "__len__") and not hasattr(value, "__dict__"):
            budget.spend(len(value))
            for item in value if isinstance(value, list) else ():
                if hasattr(item, "__dict__"):
                    _vector_elements(item, budget, depth + 1)
        elif hasattr(value, "__dict__"):
            _vector_elements(value, budget, depth + 1)


def flatbuffer_to_program_checked(data: bytes):
    """:func:`flatbuffer_to_program` for untrusted input, in bounded work and memory.

    Rejects strings and byte vectors running past the end of ``data`` (raises
    ``IndexError``) and programs that unpack into more tables and vector
    elements than ``len(data) / 4 + 1024`` (raises ``ValueError``): offsets shared
    across a crafted file would otherwise expand without bound. Any exception
    means ``data`` is not a valid program flatbuffer.
    """
    from executorch.exir._serialize._flatbuffer_program import (
        _convert_from_flatbuffer_dataclass,
        _patch_generated_flatbuffer_aliases,
    )
    from executorch.exir._serialize.generated.executorch_flatbuffer.Program import ProgramT
    from executorch.exir.schema import Program

    _install_object_budget()
    _patch_generated_flatbuffer_aliases()
    budget = _ObjectBudget(len(data))
    _ObjectBudget.active = budget
    try:
        program_t = ProgramT.InitFromPackedBuf(_BoundedBytes(data))
    finally:
        _ObjectBudget.active = None
    _vector_elements(program_t, _ObjectBudget(len(data) * 2))
    return _convert_from_flatbuffer_dataclass(program_t, Program)


#: Names of ``executorch.backends.cuda.cuda_weight_collector`` that
#: :func:`ptdstream.cuda_backend.stream_cuda_weights` replaces while active:
#: ``_write_tensor_storage(tensor, path) -> bytes`` (copies one AOTI storage to
#: ``path`` and returns its SHA-256), ``FileBackedData`` (``move_from(path,
#: sha256=None)`` turns that file into named data) and ``trim_host_memory()``
#: (``gc.collect`` + ``malloc_trim``, before and after each method's weights).
CUDA_COLLECTOR_PATCHED = ("_write_tensor_storage", "FileBackedData", "trim_host_memory")


def cuda_weight_collector():
    """executorch's CUDA backend weight collector module (``backends/cuda/cuda_weight_collector.py``).

    Raises:
        ImportError: executorch's CUDA backend is not importable.
    """
    from executorch.backends.cuda import cuda_weight_collector as collector

    return collector


#: What :func:`ptdstream.constants.constants_by_reference` relies on in
#: ``executorch.exir.emit._emitter``: ``_Emitter._tensor_spec_to_evalue(self,
#: spec, constant_tag=None)`` copies a constant with the module's only call of
#: ``bytes(...)``, on ``ctypes.cast(spec.storage.data_ptr(), ...).contents``.
EMITTER_PATCHED = ("_Emitter._tensor_spec_to_evalue", "bytes")


def emitter_module():
    """executorch's emitter module (``exir/emit/_emitter.py``)."""
    from executorch.exir.emit import _emitter

    return _emitter


#: What :func:`ptdstream.blobs.delegate_blobs_from_files` relies on: torch's
#: ``torch/_export/verifier.py`` reads its global ``bytes`` only in
#: ``Verifier._check_graph_module`` (``isinstance(processed_bytes, bytes)`` for a
#: ``LoweredBackendModule``), and executorch's ``_Emitter._emit_delegate(self,
#: lowered_module, args, kwargs)`` hashes and keeps ``lowered_module.processed_bytes``.
VERIFIER_PATCHED = ("bytes",)


def export_verifier_module():
    """torch's export verifier module (``torch/_export/verifier.py``)."""
    from torch._export import verifier

    return verifier


_shadow_lock = threading.Lock()
_shadows: Dict[Tuple[int, str], list] = {}  # (id(owner), name) -> [count, had_own, original]


@contextlib.contextmanager
def shadowed(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``owner.name = value`` (a module global or a class attribute) while any
    context for it is active; the first entry sets it, the last exit restores the
    original (or removes the name when ``owner`` did not define it itself).
    Entering again while active keeps the first value. Exits may happen in any
    thread and in any order."""
    key = (id(owner), name)
    with _shadow_lock:
        entry = _shadows.get(key)
        if entry is None:
            had_own = name in vars(owner)
            entry = _shadows[key] = [0, had_own, vars(owner).get(name)]
            setattr(owner, name, value)
        entry[0] += 1
    try:
        yield
    finally:
        with _shadow_lock:
            entry[0] -= 1
            if entry[0] == 0:
                del _shadows[key]
                if entry[1]:
                    setattr(owner, name, entry[2])
                else:
                    delattr(owner, name)
