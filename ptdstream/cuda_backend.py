"""Route executorch's CUDA backend weight storages through ptdstream.

executorch 1.5.1's ``backends/cuda/cuda_weight_collector.py`` writes every AOTI
weight storage to a temp file as it lowers each method (8 MiB pageable
``.cpu()`` chunks, SHA-256 on one core, a write), once per method, and keeps
only the first copy of each key. Inside :func:`stream_cuda_weights`, each CUDA
storage is instead wrapped as a :class:`~ptdstream.interop.SourceBackedData`
over a :class:`~ptdstream.cuda.CudaTensorSource`: nothing is copied to the host
or written while lowering; the storage's GPU fingerprint stands in for its
SHA-256 (so a later method re-adding the same key costs one fingerprint), and
``ptdstream.save`` streams each surviving storage from the GPU exactly once.
Upstream's own ``write_to_file`` still writes the same bytes (slowly).

Memory: upstream frees each AOTI storage once it has written it, so each one is
first copied on the device (at device bandwidth, no host copy); the copies of
the first method that adds each key stay on the GPU until the manager is saved
and dropped; later methods' copies are dropped as soon as their fingerprint
matches.
Dedup classes are upstream's, except that a CUDA storage and a non-CUDA blob
with equal bytes are not merged (their digests differ in kind).

CPU-resident AOTI weights keep upstream's path.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Dict, Iterator


@dataclass
class CudaWeightStats:
    """What happened inside :func:`stream_cuda_weights`: storages routed through
    ptdstream, their bytes, and storages left to upstream's path (CPU ones)."""

    routed: int = 0
    routed_nbytes: int = 0
    upstream: int = 0


@contextlib.contextmanager
def stream_cuda_weights() -> Iterator[CudaWeightStats]:
    """While active, executorch's CUDA backend hands weight storages to ptdstream.

    Patches two names of ``executorch.backends.cuda.cuda_weight_collector``
    (``_write_tensor_storage`` and the ``FileBackedData`` it uses) and restores
    them on exit. Not thread-safe: lower one model at a time inside it.

    Raises:
        ImportError: executorch's CUDA backend is not importable.
    """
    import torch
    from executorch.backends.cuda import cuda_weight_collector as collector

    from .cuda import CudaTensorSource
    from .interop import SourceBackedData

    real_write = collector._write_tensor_storage
    real_file_backed = collector.FileBackedData
    pending: Dict[str, CudaTensorSource] = {}
    stats = CudaWeightStats()

    def write_storage(tensor, path):
        if not tensor.is_cuda:
            stats.upstream += 1
            return real_write(tensor, path)
        storage = tensor.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
            storage, 0, (storage.nbytes(),), (1,)
        )
        # Upstream frees (resizes to 0) the AOTI storage once it is written; keep
        # a device-side copy (at device bandwidth) until ptdstream saves it.
        flat = flat.clone()
        source = CudaTensorSource(flat, label=f"CUDA weight storage ({storage.nbytes()} bytes)")
        pending[path] = source
        stats.routed += 1
        stats.routed_nbytes += source.nbytes
        return source.gpu_fingerprint().digest

    class _FileBackedData(real_file_backed):
        @classmethod
        def move_from(cls, path, sha256=None):
            source = pending.pop(path, None)
            if source is None:
                return real_file_backed.move_from(path, sha256=sha256)
            os.remove(path)  # the empty temp file upstream made for it
            data = SourceBackedData(source)
            data._sha256 = sha256
            return data

    collector._write_tensor_storage = write_storage
    collector.FileBackedData = _FileBackedData
    try:
        yield stats
    finally:
        collector._write_tensor_storage = real_write
        collector.FileBackedData = real_file_backed
