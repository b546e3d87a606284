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

Weights shared through lowering (``share_weights``, the default): the
per-method copies executorch makes before the first method compiles share the
program's weights (:mod:`ptdstream.hooks.cuda.sharing`), so an AOTI storage is
often the caller's own weight; it is kept by reference (``shared_nbytes``), as
a twin is; with the weights on the host, a storage that is the device copy of
one of them is served from the host tensor (:mod:`ptdstream.hooks.cuda.hosted`,
``hosted_nbytes``), before any twin is looked for: a CUDA parameter left in the
process with the same bytes (another copy of the model, or one not yet
garbage-collected) would otherwise be kept alive by the manager in its place.

CPU-resident AOTI weights keep upstream's path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .keeping import DEVICE_COPY_BUDGET_NBYTES, CudaWeightStats
from .routing import CudaWeightStream
from .trim import MALLOC_TRIM

__all__ = ["stream_cuda_weights"]


@contextlib.contextmanager
def stream_cuda_weights(
    trim_host_memory: bool | str = MALLOC_TRIM,
    twins: bool = True,
    device_copy_budget_nbytes: int | None = DEVICE_COPY_BUDGET_NBYTES,
    spill_dir: str | None = None,
    share_weights: bool = True,
) -> Iterator[CudaWeightStats]:
    """While active, executorch's CUDA backend hands weight storages to ptdstream.

    Patches names of ``executorch.backends.cuda.cuda_weight_collector``
    (``_write_tensor_storage``, ``CudaWeightCollector.materialize`` (to learn
    which storages are being collected), the ``FileBackedData`` it uses and, unless
    ``trim_host_memory`` is ``True``, ``trim_host_memory``) and, with ``share_weights``,
    ``CudaBackend.copy_exported_program_for_preprocess`` and
    ``release_moved_tensors``, and restores them when the last
    context exits (:func:`ptdstream.upstream.patching.shadowed`). Lower one model at a
    time: entering a context while another is active raises.

    Args:
        trim_host_memory: ``"malloc_trim"`` (default): upstream's ``gc.collect()``
            + ``malloc_trim(0)`` before and after each method's weights are
            skipped, and ``malloc_trim(0)`` alone runs after each method's
            collect: it hands back the heap the method's compile freed, without
            the two full garbage collections (:mod:`.trim`). ``True``: upstream's
            own; ``False``: neither.
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
        share_weights: the per-method copies of the program that executorch's
            ``CudaBackend`` makes before lowering share its weights, which are
            never released while lowering
            (:func:`ptdstream.hooks.cuda.sharing.sharing_weights`): one copy of
            the weights however many methods, on the GPU or on the host, and the
            same output; with the weights on the host, each storage that is the
            device copy of one is served from it (:mod:`.hosted`). ``False``:
            upstream's copy per method.

    Raises:
        ArgumentTypeError: a ``trim_host_memory`` that is not one of its modes.
        ImportError: executorch's CUDA backend is not importable.
        RuntimeError: a context is already active in this process.
        OSError: at entry, a ``spill_dir`` that cannot hold a spill file; while
            lowering, a spill that failed (names the folder and offset).
    """
    stream = CudaWeightStream(trim_host_memory, twins, device_copy_budget_nbytes, spill_dir, share_weights)
    stats = stream.open()
    try:
        yield stats
    finally:
        stream.close()
