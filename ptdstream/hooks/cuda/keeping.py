"""Where each CUDA weight storage's bytes stay until the save: the choice
:func:`~ptdstream.hooks.cuda.backend.stream_cuda_weights` makes per storage.

In order: a source already kept with equal bytes (a later method's storage);
the program's own weight shared by every method's copy
(:mod:`~ptdstream.hooks.cuda.sharing`: a reference); the shared host weight of
the same FQN with exactly these bytes (:mod:`~ptdstream.hooks.cuda.hosted`); a
CUDA parameter the process holds with equal bytes (:mod:`~ptdstream.hooks.cuda.twins`:
a reference); a device copy while the copies stay within
``device_copy_budget_nbytes``; else a spill to an unlinked temp file
(:mod:`~ptdstream.hooks.cuda.spill`). :class:`CudaWeightStats` counts the bytes
of each way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ...sources.base import Expectation, Source
from .sharing import host_weight
from .twins import TwinFinder, probe, same_bytes

__all__ = ["DEVICE_COPY_BUDGET_NBYTES", "CudaWeightStats", "SourceKeeping"]

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


class SourceKeeping:
    """How :class:`~ptdstream.hooks.cuda.routing.CudaWeightStream` keeps each
    storage's bytes (the module docstring's order); the stream's constructor sets
    the attributes declared here."""

    twins: bool
    device_copy_budget_nbytes: int | None
    spill_dir: str | None
    stats: CudaWeightStats
    _kept: dict[tuple[int, bytes], list[Source]]
    _positions: dict[tuple[object, int], object]
    _finder: TwinFinder | None
    _spill: Any | None


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
