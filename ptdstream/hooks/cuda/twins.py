"""Find a CUDA tensor the process already holds with the same bytes as an AOTI storage.

executorch 1.5.1's CUDA backend hands each AOTI weight storage to its collector
(``backends/cuda/cuda_weight_collector.py``) and frees it afterwards. The model's
own parameters usually still hold the same bytes on the GPU (the exported
program shares them with the model). :class:`TwinFinder` finds such a twin so
that :func:`ptdstream.hooks.cuda.backend.stream_cuda_weights` can keep a reference to
it (no device memory added) instead of a copy.

A twin is an ``nn.Parameter`` (plain tensors are left out: a scratch buffer or a
cache could be written to later) on the same device, contiguous, with exactly the
storage's number of bytes, that is not itself one of the storages being
collected. Candidates are found by one ``gc.get_objects()`` scan per collection
round, matched by size, then by
:data:`PROBE_NBYTES` sampled bytes, then confirmed exactly with ``torch.equal``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable

__all__ = ["PROBE_NBYTES", "TwinFinder", "probe", "same_bytes"]

#: Bytes sampled, evenly spread, to tell storages of one size apart before ``torch.equal``.
PROBE_NBYTES = 64


def probe(flat, positions: dict[tuple[object, int], object]) -> tuple[int, bytes]:
    """``(nbytes, PROBE_NBYTES bytes spread evenly over flat)``: one gather, one small copy.

    Args:
        flat: a contiguous 1-D ``uint8`` CUDA tensor.
        positions: a cache of the index tensor per (device, size).

    Storages with different probes differ; equal probes are confirmed (or not)
    with ``torch.equal``.
    """
    import torch

    n = flat.numel()
    if n <= PROBE_NBYTES:
        return n, bytes(flat.cpu().numpy())
    index = positions.get((flat.device, n))
    if index is None:
        index = torch.linspace(0, n - 1, PROBE_NBYTES, dtype=torch.float64, device=flat.device).long()
        positions[(flat.device, n)] = index
    return n, bytes(flat[index].cpu().numpy())


def as_bytes(tensor):
    """A contiguous CUDA tensor's bytes as a flat ``uint8`` view (no copy)."""
    import torch

    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return tensor.detach().reshape(-1).view(torch.uint8)


def same_bytes(a, b) -> bool:
    """Whether two 1-D ``uint8`` tensors (CUDA or CPU; any strides) hold the same bytes (one device sync).

    Compared as ``int64`` words when both start on an 8-byte boundary and the
    length is a multiple of 8 (the comparison's boolean result is then 8x
    smaller than for bytes); bitwise either way, so it agrees with
    ``torch.equal`` on the bytes.
    """
    import torch

    if a.numel() != b.numel() or a.device != b.device:
        return False
    if a.numel() % 8 == 0 and all(t.is_contiguous() and t.data_ptr() % 8 == 0 and t.storage_offset() % 8 == 0
                                  for t in (a, b)):
        return bool(torch.equal(a.view(torch.int64), b.view(torch.int64)))
    return bool(torch.equal(a, b))


class TwinFinder:
    """Index of the process's CUDA parameters by size, for one collection round.

    Args:
        excluded: data pointers of storages that must not be chosen (the AOTI
            storages being collected: upstream frees them).
        positions: shared probe index cache (see :func:`probe`).
    """

    def __init__(self, excluded: Iterable[int], positions: dict) -> None:
        self._excluded = set(excluded)
        self._positions = positions
        self._by_size: dict[tuple[object, int], list] | None = None
        self._probes: dict[int, tuple[int, bytes]] = {}

    def _scan(self) -> dict[tuple[object, int], list]:
        import torch

        by_size: dict[tuple[object, int], list] = {}
        seen = set()
        for obj in gc.get_objects():
            if type(obj) is not torch.nn.Parameter:
                continue
            try:
                if type(obj.data) is not torch.Tensor:  # fake, functional or subclass
                    continue
                if not obj.is_cuda or not obj.is_contiguous() or obj.numel() == 0:
                    continue
                ptr = obj.untyped_storage().data_ptr()
                addr = obj.data_ptr()
            except Exception:  # noqa: BLE001 - fake, meta or subclass tensors
                continue
            if ptr == 0 or ptr in self._excluded or addr in seen:
                continue
            seen.add(addr)
            nbytes = obj.numel() * obj.element_size()
            by_size.setdefault((obj.device, nbytes), []).append(obj)
        return by_size

    def find(self, flat, wanted: tuple[int, bytes]):
        """A held parameter whose bytes equal ``flat`` (a 1-D ``uint8`` CUDA tensor), or ``None``.

        ``wanted`` is ``probe(flat)``.
        """
        if self._by_size is None:
            self._by_size = self._scan()
        candidates = self._by_size.get((flat.device, flat.numel()), ())
        if not candidates:
            return None
        for tensor in candidates:
            key = tensor.data_ptr()
            try:
                got = self._probes.get(key)
                if got is None:
                    got = self._probes[key] = probe(as_bytes(tensor), self._positions)
                if got == wanted and same_bytes(as_bytes(tensor), flat):
                    return tensor
            except RuntimeError:  # a candidate that cannot be read: not a twin
                continue
        return None
