"""Route executorch's CUDA backend weight storages through ptdstream.

executorch 1.5.1's ``backends/cuda/cuda_weight_collector.py`` writes every AOTI
weight storage to a temp file as it lowers each method (8 MiB pageable
``.cpu()`` chunks, SHA-256 on one core, a write), once per method, and keeps
only the first copy of each key. Inside :func:`stream_cuda_weights`, each CUDA
storage is instead wrapped as a :class:`~ptdstream.hooks.interop.SourceBackedData`
over a :class:`~ptdstream.sources.cuda.CudaTensorSource`: nothing is copied to the host
or written while lowering; the storage's GPU fingerprint stands in for its
SHA-256 (so a later method re-adding the same key costs one fingerprint), and
``ptdstream.save`` streams each surviving storage from the GPU exactly once.
Upstream's own ``write_to_file`` still writes the same bytes (slowly).

Memory: upstream frees each AOTI storage once it has written it. For each
distinct content, ptdstream keeps instead a reference to a CUDA parameter the
process already holds with equal bytes (the model's, which the exported program
shares; found by size, sampled bytes and ``torch.equal``:
:mod:`ptdstream.hooks.cuda.twins`), so no device memory is added. A storage
with no such twin is copied on the device (at device bandwidth, no host copy)
while the copies kept stay within ``device_copy_budget_nbytes`` (1 GiB by
default), and that copy stays on the GPU until the manager is saved and
dropped; beyond the budget it is spilled instead: copied through the pinned
ring into an unlinked temp file (:mod:`ptdstream.hooks.cuda.spill`, pages dropped)
and read back from there at the save, which is what upstream does with every
storage. So the GPU holds at most the budget more than upstream's export. A
later method's storage whose bytes equal a kept source's reuses it: no second
copy and no second fingerprint. A method that re-adds every
weight costs one comparison per storage: the source kept for the same FQN in
an earlier method is tried first (AOTI hands each method its own copy of every
weight, in the same order); the probe and the other candidates only when that
one differs. A spilled storage is matched by its GPU fingerprint (as
upstream matches every storage by its SHA-256). Every kept source carries its
GPU fingerprint; the save recomputes it after copying the bytes out and refuses
(naming the key) a twin that was changed in the meantime; spilled bytes are
checked against the xxh3-128 digest taken when they were spilled.
Dedup classes are upstream's, except that a CUDA storage and a non-CUDA blob
with equal bytes are not merged (their digests differ in kind).

CPU-resident AOTI weights keep upstream's path.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

from ...upstream import adapter
from .twins import PROBE_NBYTES, TwinFinder, probe, same_bytes
from ...upstream.patching import is_shadowed, shadowed

__all__ = ["CudaWeightStats", "DEVICE_COPY_BUDGET_NBYTES", "PROBE_NBYTES", "stream_cuda_weights"]

#: Device memory (bytes) that copies of storages without a twin may take before
#: the next ones are spilled to disk: the most the GPU holds beyond upstream's export.
DEVICE_COPY_BUDGET_NBYTES = 1 << 30


@dataclass
class CudaWeightStats:
    """What happened inside :func:`stream_cuda_weights`.

    ``routed``/``routed_nbytes``: CUDA storages handed to ptdstream and their
    bytes (every method counted); ``copied_nbytes``: device memory (bytes) added
    for copies of storages that had no twin, each distinct content once (in
    the allocator's 512-byte blocks);
    ``twin_nbytes``: bytes of distinct storages served by a parameter the process
    already held (no memory added); ``spilled_nbytes``: bytes of distinct
    storages spilled to a temp file (beyond the device copy budget);
    ``upstream``: storages left to upstream's path (CPU ones)."""

    routed: int = 0
    routed_nbytes: int = 0
    copied_nbytes: int = 0
    twin_nbytes: int = 0
    spilled_nbytes: int = 0
    upstream: int = 0


#: The CUDA caching allocator's granularity (bytes): a copy takes whole blocks.
_ALLOCATOR_BLOCK_NBYTES = 512


def _blocks(nbytes: int) -> int:
    """Device memory (bytes) a copy of ``nbytes`` bytes takes."""
    return -(-nbytes // _ALLOCATOR_BLOCK_NBYTES) * _ALLOCATOR_BLOCK_NBYTES


@contextlib.contextmanager
def stream_cuda_weights(
    trim_host_memory: bool = False,
    twins: bool = True,
    device_copy_budget_nbytes: Optional[int] = DEVICE_COPY_BUDGET_NBYTES,
    spill_dir: Optional[str] = None,
) -> Iterator[CudaWeightStats]:
    """While active, executorch's CUDA backend hands weight storages to ptdstream.

    Patches names of ``executorch.backends.cuda.cuda_weight_collector``
    (``_write_tensor_storage``, ``CudaWeightCollector.materialize`` (to learn
    which storages are being collected), the ``FileBackedData`` it uses and, unless
    ``trim_host_memory``, ``trim_host_memory``) and restores them when the last
    context exits (:func:`ptdstream.upstream.patching.shadowed`). Lower one model at a
    time: entering a context while another is active raises.

    Args:
        trim_host_memory: keep upstream's ``gc.collect()`` + ``malloc_trim(0)``
            before and after each method's weights. They hand back the host
            memory of upstream's ``.cpu()`` chunks; routed weights use none, and
            the two full collections cost about 0.5 s per method on a lowered
            model (measured on the H200 by ``benchmarks/bench_cuda_backend.py``),
            so by default they are skipped.
        twins: serve a storage from a CUDA ``nn.Parameter`` the process already
            holds with equal bytes (no device memory added) when there is one;
            ``False``: never look for one (every storage is copied or spilled).
        device_copy_budget_nbytes: device memory (bytes) the copies of storages
            without a twin may take (1 GiB); a storage that does not fit is
            spilled to an unlinked temp file in ``spill_dir`` instead. ``None``:
            no limit (never spill); ``0``: spill every storage without a twin.
        spill_dir: folder of the spill file (default: the folder upstream's
            collector writes its own temp files to). It needs room for the
            spilled bytes until the save.

    Raises:
        ImportError: executorch's CUDA backend is not importable.
        RuntimeError: a context is already active in this process.
        OSError: at entry, a ``spill_dir`` that cannot hold a spill file; while
            lowering, a spill that failed (names the folder and offset).
    """
    import torch

    from ...sources.base import Expectation
    from ...sources.cuda import CudaTensorSource
    from ...sources.cuda_fingerprint import gpu_fingerprint
    from .spill import SpillFile, SpilledSource
    from ..interop import SourceBackedData

    collector = adapter.cuda_weight_collector()
    if is_shadowed(collector, "_write_tensor_storage"):
        raise RuntimeError("stream_cuda_weights is already active in this process: lower one model at a "
                           "time (a second context would leave its budget, spill folder and stats unused)")
    if spill_dir is not None:
        SpillFile(spill_dir).close()  # a missing or read-only folder now, not in the middle of lowering
    real_write = collector._write_tensor_storage
    real_file_backed = collector.FileBackedData
    real_materialize = collector.CudaWeightCollector.materialize
    pending: Dict[str, CudaTensorSource] = {}
    kept: Dict[Tuple[int, bytes], List[CudaTensorSource]] = {}
    positions: Dict[Tuple[object, int], object] = {}
    by_fqn: Dict[str, CudaTensorSource] = {}  # the source last chosen for each FQN
    fqn_of: Dict[int, str] = {}  # storage data pointer -> FQN, for the current round
    warmed: set = set()
    stats = CudaWeightStats()
    rounds: List[Optional[TwinFinder]] = [None]
    spills: List[SpillFile] = []

    def same(source, flat, fingerprints: List) -> bool:
        """Whether ``source`` holds ``flat``'s bytes (``fingerprints``: flat's, once computed)."""
        if isinstance(source, SpilledSource):
            if not fingerprints:
                fingerprints.append(gpu_fingerprint(flat))
            return source.gpu_fingerprint() == fingerprints[0]
        return same_bytes(source._flat(), flat)

    def materialize(self, weights, *args, **kwargs):
        excluded = set()
        for fqn, (tensor, _) in weights.items():
            try:
                ptr = tensor.untyped_storage().data_ptr()
            except Exception:  # noqa: BLE001 - not a real tensor: nothing to exclude
                continue
            excluded.add(ptr)
            fqn_of[ptr] = fqn
        rounds[0] = TwinFinder(excluded, positions) if twins else None
        try:
            return real_materialize(self, weights, *args, **kwargs)
        finally:
            rounds[0] = None
            fqn_of.clear()

    def write_storage(tensor, path):
        if not tensor.is_cuda:
            stats.upstream += 1
            return real_write(tensor, path)
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
            storage, 0, (nbytes,), (1,)
        )
        fqn = fqn_of.get(storage.data_ptr())
        guess = by_fqn.get(fqn) if fqn is not None else None
        if flat.device not in warmed and flat.numel():
            warmed.add(flat.device)
            # Load the comparison's kernels now, with the first method's storages,
            # rather than on the first comparison of the next method (~25 ms).
            head = flat[: 1 << 16]  # large enough for the vectorized kernels
            same_bytes(head.clone(), head)
        fingerprints: List = []
        if guess is not None and guess.nbytes == nbytes and same(guess, flat, fingerprints):
            source = guess  # this FQN's storage of an earlier method, unchanged
        else:
            source = find_or_keep(flat, storage, nbytes, fingerprints, path)
        if fqn is not None:
            by_fqn[fqn] = source
        pending[path] = source
        stats.routed += 1
        stats.routed_nbytes += source.nbytes
        return source.gpu_fingerprint().digest

    def find_or_keep(flat, storage, nbytes, fingerprints, path):
        """A kept source with ``flat``'s bytes, else a new one (twin, device copy or spill)."""
        wanted = probe(flat, positions)
        for source in kept.get(wanted, ()):
            if same(source, flat, fingerprints):
                return source  # a later method's equal storage: reuse the kept source
        finder = rounds[0]
        if finder is None and twins:
            finder = TwinFinder({storage.data_ptr()}, positions)
        twin = finder.find(flat, wanted) if finder is not None and nbytes else None
        label = f"CUDA weight storage ({nbytes} bytes)"
        if not fingerprints:
            fingerprints.append(gpu_fingerprint(flat))
        expectation = Expectation(gpu_fingerprint=fingerprints[0])
        if twin is not None:
            # A parameter the process holds with these bytes: keep a reference.
            source = CudaTensorSource(twin, label=label + " held by a parameter", expectation=expectation)
            stats.twin_nbytes += nbytes
        elif device_copy_budget_nbytes is None or stats.copied_nbytes + _blocks(nbytes) <= device_copy_budget_nbytes:
            # Upstream frees (resizes to 0) the AOTI storage once it is written;
            # keep a device-side copy (at device bandwidth) until ptdstream saves it.
            source = CudaTensorSource(flat.clone(), label=label, expectation=expectation)
            stats.copied_nbytes += _blocks(nbytes)
        else:
            # Over the budget: to disk, through the pinned ring, before upstream frees it.
            if not spills:
                spills.append(SpillFile(spill_dir or os.path.dirname(os.path.abspath(path))))
            source = spills[0].append(CudaTensorSource(flat, label=label), label, gpu_fingerprint=fingerprints[0])
            stats.spilled_nbytes += nbytes
            kept.setdefault(wanted, []).append(source)
            return source
        kept.setdefault(wanted, []).append(source)
        return source

    class _FileBackedData(real_file_backed):
        @classmethod
        def move_from(cls, path, sha256=None):
            source = pending.pop(path, None)
            if source is None:
                return real_file_backed.move_from(path, sha256=sha256)
            os.remove(path)  # the empty temp file upstream made for it
            return SourceBackedData(source, sha256=sha256)

    with contextlib.ExitStack() as patches:
        patches.enter_context(shadowed(collector, "_write_tensor_storage", write_storage))
        patches.enter_context(shadowed(collector, "FileBackedData", _FileBackedData))
        patches.enter_context(shadowed(collector.CudaWeightCollector, "materialize", materialize))
        if not trim_host_memory:
            patches.enter_context(shadowed(collector, "trim_host_memory", lambda: None))
        try:
            yield stats
        finally:
            kept.clear()
            by_fqn.clear()
            positions.clear()
            spills.clear()  # the file lives on while its sources do
