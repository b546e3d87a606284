"""The routing of one :func:`~ptdstream.hooks.cuda.backend.stream_cuda_weights`
context: :class:`CudaWeightStream` puts its patches in executorch's CUDA weight
collector, answers the collector's calls (each method's ``materialize``, each
storage's write and ``move_from``) with ptdstream sources, and takes the patches
out again. Where each storage's bytes stay is :mod:`~ptdstream.hooks.cuda.keeping`.
"""

from __future__ import annotations

import contextlib
import enum
import os
from typing import Any

from ...errors import StateError
from ...sources.base import Source
from ...upstream import adapter
from ...upstream.patching import is_shadowed, shadowed
from .keeping import DEVICE_COPY_BUDGET_NBYTES, CudaWeightStats, SourceKeeping
from .sharing import is_shared, sharing_weights
from .trim import MALLOC_TRIM, check_mode, malloc_trim
from .twins import TwinFinder, same_bytes

__all__ = ["CudaWeightStream", "StreamState"]


class StreamState(enum.Enum):
    """Where a :class:`CudaWeightStream` is: made, routing (patches in place), closed."""

    READY = "ready"
    ROUTING = "routing"
    CLOSED = "closed"


class CudaWeightStream(SourceKeeping):
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
