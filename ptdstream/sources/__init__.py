"""Sources: where segment payload comes from, read in fixed-size pieces.

* ``base``: the :class:`Source` protocol with its frozen ``Expectation``
  (fingerprints, a file's ``FileIdentity``), ``is_mutable`` and ``hand_over()``;
  :class:`BufferRing`, the reused ring every read goes through.
* ``memory``, ``file``, ``tensor``: bytes, file ranges, CPU tensors; ``concat``:
  other sources one after another (a checkpoint key derived from byte ranges of
  its tensors, ``Checkpoint.derive``).
* ``mapped``: memory-mapped checkpoints, read with ``pread`` while the mapped
  inode is still at its path and the memory is the file's (no private copy per
  ``/proc/self/pagemap``), else through the mapping; the file's identity when the
  checkpoint was opened checked at every read.
* ``checkpoint`` (``open_checkpoint``: safetensors, Hugging Face shards,
  weights-only ``torch.save``, detected; DCP, a pickle, only with
  ``format="dcp"``), ``checkpoint_base`` (the ``Checkpoint`` and its entries),
  ``checkpoint_mapped`` (the safetensors and ``torch.save`` kinds),
  ``checkpoint_dcp`` (a tensor loaded when read, the second load checked against
  the first), ``safetensors_header`` (a header checked against its file before it
  is mapped, in one validating pass).
* ``cuda`` (the pinned ring; imported only when a CUDA tensor is seen),
  ``fingerprint`` / ``digest`` (the dedup candidate key and xxh3-128) and
  ``cuda_fingerprint`` (a prime-field hash computed on the GPU, no cuBLAS).

:func:`as_source` wraps anything ptdstream can read.
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
