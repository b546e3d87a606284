"""Every private ExecuTorch name ptdstream relies on, in one place.

Checked against executorch 1.5.1 (:data:`CHECKED_VERSIONS`). ``tests/test_upstream.py``
imports each of them and fails loudly when a release renames or removes one.
Public API (``NamedDataStore``, ``ExecutorchProgramManager``, ``FileBackedData``)
is imported where it is used.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

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
    """Yield a ``Cord``'s bytes in pieces without joining them (bounded memory)."""
    from executorch.exir._serialize._cord import FileBackedData

    for item in cord._buffers:
        if isinstance(item, FileBackedData):
            with open(item._path, "rb") as f:
                while True:
                    piece = f.read(chunk_nbytes)
                    if not piece:
                        break
                    yield piece
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


def flatbuffer_to_program_checked(data: bytes):
    """:func:`flatbuffer_to_program` that also rejects strings and byte vectors
    running past the end of ``data`` (raises ``IndexError`` for them). Any
    exception means ``data`` is not a valid program flatbuffer."""
    return flatbuffer_to_program(_BoundedBytes(data))
