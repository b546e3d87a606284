"""Sources: where segment payload comes from, read in fixed-size pieces.

``base`` (the :class:`Source` protocol, :class:`BufferRing`), ``memory``, ``file``,
``tensor``, ``mapped`` (memory-mapped checkpoints), ``cuda`` (imported only when a
CUDA tensor is seen), ``fingerprint`` and ``cuda_fingerprint`` (content identity).
"""

from __future__ import annotations

import sys
from typing import Any

from ..upstream import adapter
from .base import BufferRing, Source
from .file import FileRangeSource
from .memory import MemorySource
from .tensor import TensorSource

__all__ = ["BufferRing", "FileRangeSource", "MemorySource", "Source", "TensorSource", "as_source", "is_tensor"]


def is_tensor(data: Any) -> bool:
    """Whether ``data`` is a ``torch.Tensor`` (without importing torch when it is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(data, torch.Tensor)


def as_source(data: Any, label: str = "data") -> Source:
    """Wrap anything ptdstream can read into a :class:`Source`.

    Accepts a :class:`Source` (returned as is), ``bytes``/``bytearray``/
    ``memoryview``, a CPU or CUDA ``torch.Tensor`` (the CUDA source is imported
    only then), executorch's ``FileBackedData``, and any object whose type has a
    ``__ptdstream_source__()`` method.

    Raises:
        TypeError: any other type, with upstream's text
            ("Unsupported named data type: ...").
    """
    if isinstance(data, Source):
        return data
    if isinstance(data, (bytes, bytearray, memoryview)):
        return MemorySource(data, label)
    provider = getattr(type(data), "__ptdstream_source__", None)
    if provider is not None:
        source: Source = provider(data)  # ptdstream.hooks.interop types: the fast path
        return source
    path = adapter.file_backed_path(data)
    if path is not None:
        return FileRangeSource(path, 0, len(data))
    if is_tensor(data):
        if data.device.type == "cuda":
            from .cuda import CudaTensorSource

            return CudaTensorSource(data, label)
        return TensorSource(data, label)
    raise TypeError(f"Unsupported named data type: {type(data)}")
