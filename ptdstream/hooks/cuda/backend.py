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
import enum
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ...errors import StateError
from ...sources.base import Expectation, Source
from ...upstream import adapter
from ...upstream.patching import is_shadowed, shadowed
from .sharing import host_weight, is_shared, sharing_weights
from .trim import MALLOC_TRIM, check_mode, malloc_trim
from .twins import PROBE_NBYTES, TwinFinder, probe, same_bytes

__all__ = ["CudaWeightStats", "CudaWeightStream", "DEVICE_COPY_BUDGET_NBYTES", "PROBE_NBYTES", "StreamState",
           "stream_cuda_weights"]

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
    ``upstream``: storages left to upstream's path (CPU ones); ``shared_nbytes``:
    bytes of distinct storages that are the program's own weights, shared by
    every method's copy (``share_weights``; no memory added); ``hosted_nbytes``:
    bytes of distinct CUDA storages served from the shared host weight of the
    same FQN and bytes (weights on the host; no device memory added)."""

    routed: int = 0
    routed_nbytes: int = 0
    copied_nbytes: int = 0
    twin_nbytes: int = 0
    spilled_nbytes: int = 0
    upstream: int = 0
    shared_nbytes: int = 0
    hosted_nbytes: int = 0


#: The CUDA caching allocator's granularity (bytes): a copy takes whole blocks.
_ALLOCATOR_BLOCK_NBYTES = 512


def _blocks(nbytes: int) -> int:
    """Device memory (bytes) a copy of ``nbytes`` bytes takes."""
    return -(-nbytes // _ALLOCATOR_BLOCK_NBYTES) * _ALLOCATOR_BLOCK_NBYTES


class StreamState(enum.Enum):
    """Where a :class:`CudaWeightStream` is: made, routing (patches in place), closed."""

    READY = "ready"
    ROUTING = "routing"
    CLOSED = "closed"


class CudaWeightStream:
    """The state of one :func:`stream_cuda_weights` context: its options, its
    patches and the sources it kept.

    Calls, in order: 1) :meth:`open` (checks the process and the spill folder,
    puts the patches in place: ``READY`` -> ``ROUTING``); 2) lowering, during
    which executorch's collector calls :meth:`materialize` once per method and,
    inside it, :meth:`write_storage` and :meth:`move_from` per storage; 3)
    :meth:`close` (removes the patches and forgets the kept sources, which live
    on in the manager: -> ``CLOSED``; idempotent). Each phase method first checks
    the state and raises ``StateError`` naming the expected and the actual one.
    A context manager (``with CudaWeightStream(...) as stats``) opens and closes
    it. Not thread-safe: one lowering at a time, in one thread.

    Args: as :func:`stream_cuda_weights`.
    """

    def __init__(self, trim_host_memory: bool | str = MALLOC_TRIM, twins: bool = True,
                 device_copy_budget_nbytes: int | None = DEVICE_COPY_BUDGET_NBYTES,
                 spill_dir: str | None = None, share_weights: bool = True) -> None:
        self.trim_host_memory = check_mode(trim_host_memory)
        self.share_weights = share_weights
        self.twins = twins
        self.device_copy_budget_nbytes = device_copy_budget_nbytes
        self.spill_dir = spill_dir
        self.state = StreamState.READY
        self.stats = CudaWeightStats()
        self._patches: contextlib.ExitStack | None = None
        self._real: dict[str, Any] = {}  # the collector's names the patches replace
        self._pending: dict[str, Source] = {}  # upstream's temp path -> the source written for it
        self._kept: dict[tuple[int, bytes], list[Source]] = {}  # probe -> sources kept
        self._positions: dict[tuple[object, int], object] = {}  # probe index cache
        self._by_fqn: dict[str, Source] = {}  # the source last chosen for each FQN
        self._fqn_of: dict[int, str] = {}  # storage data pointer -> FQN, for the current round
        self._warmed: set = set()
        self._finder: TwinFinder | None = None  # this round's, inside materialize
        self._spill: Any | None = None  # the SpillFile, made at the first spill

    def _expect(self, state: StreamState, what: str) -> None:
        if self.state is not state:
            raise StateError(f"stream_cuda_weights: {what} expects state {state.value}, "
                             f"but it is {self.state.value}")

    # ------------------------------------------------------------------ phases

    def open(self) -> CudaWeightStats:
        """Put the patches in place; returns the stats this context fills.

        Raises:
            StateError: not ``READY``.
            ImportError: executorch's CUDA backend is not importable.
            RuntimeError: a context is already active in this process.
            OSError: a ``spill_dir`` that cannot hold a spill file.
        """
        from .spill import SpillFile

        self._expect(StreamState.READY, "open")
        collector = adapter.cuda_weight_collector()
        if is_shadowed(collector, "_write_tensor_storage"):
            raise RuntimeError("stream_cuda_weights is already active in this process: lower one model at a "
                               "time (a second context would leave its budget, spill folder and stats unused)")
        if self.spill_dir is not None:
            SpillFile(self.spill_dir).close()  # a missing or read-only folder now, not in the middle of lowering
        self._real = {"write": collector._write_tensor_storage, "file_backed": collector.FileBackedData,
                      "materialize": collector.CudaWeightCollector.materialize}
        stream = self

        def materialize(collector_self, weights, *args, **kwargs):
            return stream.materialize(collector_self, weights, *args, **kwargs)

        file_backed: Any = self._real["file_backed"]

        class _FileBackedData(file_backed):
            @classmethod
            def move_from(cls, path, sha256=None):
                return stream.move_from(path, sha256)

        patches = contextlib.ExitStack()
        with patches:
            patches.enter_context(shadowed(collector, "_write_tensor_storage", self.write_storage))
            patches.enter_context(shadowed(collector, "FileBackedData", _FileBackedData))
            patches.enter_context(shadowed(collector.CudaWeightCollector, "materialize", materialize))
            if self.trim_host_memory is not True:
                patches.enter_context(shadowed(collector, "trim_host_memory", lambda: None))
            if self.share_weights:
                try:
                    backend = adapter.cuda_backend()
                except ImportError:  # no CudaBackend class (no triton): no lowering to share for
                    backend = None
                if backend is not None:
                    patches.enter_context(sharing_weights(backend))
            self._patches = patches.pop_all()
        self.state = StreamState.ROUTING
        return self.stats

    def close(self) -> None:
        """Remove the patches and forget the kept sources (idempotent); the sources
        handed out, and the spill file they read, live on with the manager."""
        if self.state is StreamState.CLOSED:
            return
        self._kept.clear()
        self._by_fqn.clear()
        self._positions.clear()
        self._pending.clear()
        self._fqn_of.clear()
        self._spill = None  # the file lives on while its sources do
        patches, self._patches = self._patches, None
        self.state = StreamState.CLOSED
        if patches is not None:
            patches.close()

    def __enter__(self) -> CudaWeightStats:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the collector's calls

    def materialize(self, collector_self, weights, *args, **kwargs):
        """``CudaWeightCollector.materialize`` (one method's weights): learns each
        storage's FQN and the storages being collected (no twin among them)."""
        self._expect(StreamState.ROUTING, "materialize")
        excluded = set()
        for fqn, (tensor, _) in weights.items():
            try:
                ptr = tensor.untyped_storage().data_ptr()
            except Exception:  # noqa: BLE001 - not a real tensor: nothing to exclude
                continue
            excluded.add(ptr)
            self._fqn_of[ptr] = fqn
        self._finder = TwinFinder(excluded, self._positions) if self.twins else None
        try:
            return self._real["materialize"](collector_self, weights, *args, **kwargs)
        finally:
            self._finder = None
            self._fqn_of.clear()
            if self.trim_host_memory == MALLOC_TRIM:
                malloc_trim()  # the heap this method's compile freed (trim.py)

    def write_storage(self, tensor, path):
        """``_write_tensor_storage``: a CUDA storage becomes a source (kept for
        ``path``); returns its GPU fingerprint's digest, the key upstream dedups by.
        A CPU storage goes upstream's way."""
        import torch

        self._expect(StreamState.ROUTING, "write_storage")
        if not tensor.is_cuda:
            self.stats.upstream += 1
            return self._real["write"](tensor, path)
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
            storage, 0, (nbytes,), (1,)
        )
        fqn = self._fqn_of.get(storage.data_ptr())
        guess = self._by_fqn.get(fqn) if fqn is not None else None
        if flat.device not in self._warmed and flat.numel():
            self._warmed.add(flat.device)
            # Load the comparison's kernels now, with the first method's storages,
            # rather than on the first comparison of the next method (~25 ms).
            head = flat[: 1 << 16]  # large enough for the vectorized kernels
            same_bytes(head.clone(), head)
        fingerprints: list = []
        if guess is not None and guess.nbytes == nbytes and self._same(guess, flat, fingerprints):
            source = guess  # this FQN's storage of an earlier method, unchanged
        else:
            source = self._find_or_keep(flat, storage, nbytes, fingerprints, path, is_shared(tensor), fqn)
        if fqn is not None:
            self._by_fqn[fqn] = source
        self._pending[path] = source
        self.stats.routed += 1
        self.stats.routed_nbytes += source.nbytes
        return source.gpu_fingerprint().digest

    def move_from(self, path, sha256=None):
        """``FileBackedData.move_from``: the source written for ``path`` as a
        ``SourceBackedData`` carrying upstream's key (``sha256``); any other path
        goes upstream's way."""
        from ..interop import SourceBackedData

        self._expect(StreamState.ROUTING, "move_from")
        source = self._pending.pop(path, None)
        if source is None:
            return self._real["file_backed"].move_from(path, sha256=sha256)
        os.remove(path)  # the empty temp file upstream made for it
        return SourceBackedData(source, sha256=sha256)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _same(source, flat, fingerprints: list) -> bool:
        """Whether ``source`` holds ``flat``'s bytes (``fingerprints``: flat's, once computed)."""
        from ...sources.cuda_fingerprint import gpu_fingerprint
        from .hosted import HostWeightSource
        from .spill import SpilledSource

        if isinstance(source, (SpilledSource, HostWeightSource)):
            if not fingerprints:
                fingerprints.append(gpu_fingerprint(flat))
            return source.gpu_fingerprint() == fingerprints[0]
        held = source._flat()
        if held.data_ptr() == flat.data_ptr() and held.numel() == flat.numel() and held.device == flat.device:
            return True  # the same memory (a shared weight handed in again by a later method)
        return same_bytes(held, flat)

    def _find_or_keep(self, flat, storage, nbytes, fingerprints, path, shared=False, fqn=None):
        """A kept source with ``flat``'s bytes, else a new one, in this order: shared weight,
        the shared host weight of ``fqn`` (exactly these bytes), twin, device copy, spill."""
        from ...sources.cuda import CudaTensorSource
        from ...sources.cuda_fingerprint import gpu_fingerprint
        from .hosted import HostWeightSource, equal_to_host
        from .spill import SpillFile

        wanted = probe(flat, self._positions)
        for source in self._kept.get(wanted, ()):
            if self._same(source, flat, fingerprints):
                return source  # a later method's equal storage: reuse the kept source
        # The shared host weight of this FQN first: it is the program's own and lives
        # as long as the program, where a twin may be any parameter left in the process.
        host = host_weight(fqn) if fqn is not None and not shared else None
        hosted = host is not None and equal_to_host(host, flat)
        finder = self._finder
        if finder is None and self.twins:
            finder = TwinFinder({storage.data_ptr()}, self._positions)
        twin = (finder.find(flat, wanted) if finder is not None and nbytes and not shared and not hosted
                else None)
        label = f"CUDA weight storage ({nbytes} bytes)"
        if not fingerprints:
            fingerprints.append(gpu_fingerprint(flat))
        expectation = Expectation(gpu_fingerprint=fingerprints[0])
        budget = self.device_copy_budget_nbytes
        source: Source
        if shared:
            # The program's own weight, shared by every method's copy and never
            # released while lowering (sharing.py): keep a reference.
            source = CudaTensorSource(flat, label=label + " shared with the program", expectation=expectation)
            self.stats.shared_nbytes += nbytes
        elif hosted:
            # The device copy of a shared host weight (weights on the host): serve it from there.
            source = HostWeightSource(host, label + " served from the host weight", fingerprints[0])
            self.stats.hosted_nbytes += nbytes
        elif twin is not None:
            # A parameter the process holds with these bytes: keep a reference.
            source = CudaTensorSource(twin, label=label + " held by a parameter", expectation=expectation)
            self.stats.twin_nbytes += nbytes
        elif budget is None or self.stats.copied_nbytes + _blocks(nbytes) <= budget:
            # Upstream frees (resizes to 0) the AOTI storage once it is written;
            # keep a device-side copy (at device bandwidth) until ptdstream saves it.
            source = CudaTensorSource(flat.clone(), label=label, expectation=expectation)
            self.stats.copied_nbytes += _blocks(nbytes)
        else:
            # Over the budget: to disk, through the pinned ring, before upstream frees it.
            if self._spill is None:
                self._spill = SpillFile(self.spill_dir or os.path.dirname(os.path.abspath(path)))
            source = self._spill.append(CudaTensorSource(flat, label=label), label,
                                        gpu_fingerprint=fingerprints[0])
            self.stats.spilled_nbytes += nbytes
        self._kept.setdefault(wanted, []).append(source)
        return source


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
