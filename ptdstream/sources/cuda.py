"""CUDA tensor sources: device-to-host copies through a reused pinned ring.

Imported lazily (by :func:`ptdstream.sources.as_source` when it meets a CUDA
tensor): everything else imports and runs without CUDA.

Each piece is copied on a dedicated stream into the next pinned buffer of a
ring allocated once per (device, chunk size) and reused by every source; the
copies of the next ``count - 2`` pieces are queued before a piece is handed on,
so device-to-host copies overlap hashing and the writer thread's file writes
(:func:`ptdstream.write.writer.write_plan`). Dedup between CUDA sources happens on the
device (:mod:`ptdstream.sources.cuda_fingerprint`, then ``torch.equal``): a storage
added again, under the same or another key, costs no host copy and no write.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import IntegrityError, LayoutError
from ..timeline import StageTimeline, stage_timeline
from .base import NO_EXPECTATION, BufferRing, Expectation, Source
from .digest import Fingerprint
from .tensor import check_storage

if TYPE_CHECKING:
    import torch

__all__ = ["CudaTensorSource", "PinnedRing"]

_RINGS: dict[tuple[int, int, int], PinnedRing] = {}
_RINGS_LOCK = threading.Lock()


class PinnedRing:
    """``count`` pinned host buffers of ``chunk_nbytes`` bytes and one copy stream.

    Allocated once per (device, chunk size, count) and reused; never freed
    before process exit. Host memory held: ``count * chunk_nbytes`` bytes.
    """

    def __init__(self, device: torch.device, chunk_nbytes: int, count: int) -> None:
        import torch

        self.device = device
        self.chunk_nbytes = chunk_nbytes
        self.buffers: list[torch.Tensor] = [
            torch.empty(chunk_nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)
        ]
        self.events = [torch.cuda.Event() for _ in range(count)]  # type: ignore[no-untyped-call]  # torch: unannotated
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # torch: unannotated __new__

    @staticmethod
    def get(device: torch.device, chunk_nbytes: int, count: int = 4) -> PinnedRing:
        """The ring of ``device`` for ``(chunk_nbytes, count)``, made at the first call (thread-safe)."""
        key = (device.index or 0, chunk_nbytes, count)
        with _RINGS_LOCK:
            ring = _RINGS.get(key)
            if ring is None:
                ring = _RINGS[key] = PinnedRing(device, chunk_nbytes, count)
            return ring


class CudaTensorSource(Source):
    """A CUDA tensor's bytes (any dtype, bf16 and fp8 included), copied to the host in pieces.

    The tensor must be contiguous (any storage offset). The bytes equal those of
    the same tensor moved to the CPU.

    Args:
        tensor: the CUDA tensor (kept by reference; nothing is copied here).
        label: what it is, for error messages.
        ring_count: pinned buffers in the ring (>= 3).
        expectation: with a ``gpu_fingerprint`` (a source that stands for bytes
            someone else holds, e.g. one made by
            :func:`ptdstream.hooks.cuda.backend.stream_cuda_weights`), the GPU
            fingerprint is recomputed once every byte is copied out and a
            difference is refused; it also serves :meth:`gpu_fingerprint`.

    Raises:
        LayoutError: a non-contiguous tensor ("call .contiguous()").
        IntegrityError: at write time, when the storage was freed or resized, or
            (``expectation.gpu_fingerprint`` given) when the bytes' GPU
            fingerprint differs from it.
    """

    def __init__(self, tensor: torch.Tensor, label: str = "tensor", ring_count: int = 4,
                 expectation: Expectation = NO_EXPECTATION) -> None:
        if not tensor.is_contiguous():
            raise LayoutError(
                f"{label}: CUDA tensor with shape {tuple(tensor.shape)} is not contiguous; "
                "call .contiguous() on it before adding it"
            )
        if ring_count < 3:
            raise LayoutError(f"{label}: ring_count must be >= 3, got {ring_count}")
        self._tensor = tensor.detach()
        self._label = label
        self._ring_count = ring_count
        self.nbytes = tensor.numel() * tensor.element_size()
        self._expectation = expectation
        self._gpu_fingerprint = expectation.gpu_fingerprint  # a cache, filled on first use

    def hand_over(self, fingerprint: Fingerprint | None = None) -> CudaTensorSource:
        """A CUDA source takes no host digest at hand-over (it would copy the whole
        tensor to the host once more): it proves at write time the GPU fingerprint
        of its expectation, when it was given one. A given ``fingerprint`` is
        recorded as by :meth:`Source.hand_over`."""
        if fingerprint is not None:
            super().hand_over(fingerprint)
        return self

    def gpu_fingerprint(self) -> Fingerprint:
        """This tensor's :func:`~ptdstream.sources.cuda_fingerprint.gpu_fingerprint` (cached;
        the expectation's, when it was given one)."""
        if self._gpu_fingerprint is None:
            from .cuda_fingerprint import gpu_fingerprint

            self._gpu_fingerprint = gpu_fingerprint(self._flat())
        return self._gpu_fingerprint

    def same_content(self, other: Source) -> bool | None:
        """Compare with another CUDA source on the device, without any host copy.

        The same storage range is equal at once; otherwise the GPU fingerprints
        are compared and, when they match and both tensors are on one device,
        equality is confirmed exactly with ``torch.equal``. ``None`` (let the
        caller digest on the host) when ``other`` is not a CUDA source.
        """
        import torch

        if not isinstance(other, CudaTensorSource):
            return None
        a, b = self._flat(), other._flat()
        if a.device == b.device and a.data_ptr() == b.data_ptr() and a.numel() == b.numel():
            return True
        if a.numel() != b.numel() or self.gpu_fingerprint() != other.gpu_fingerprint():
            return False
        if a.device == b.device:
            return bool(torch.equal(a, b))
        return True

    def describe(self) -> str:
        t = self._tensor
        return f"{self._label} {str(t.dtype).replace('torch.', '')}{list(t.shape)} on {t.device}"

    def _flat(self) -> torch.Tensor:
        import torch

        t = self._tensor
        check_storage(t, int(t.storage_offset()) * t.element_size(), self.nbytes, self.describe())
        if self.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=t.device)
        return t.reshape(-1).view(torch.uint8)

    def prefix(self, nbytes: int = 32) -> bytes:
        flat = self._flat()
        return bytes(flat[:nbytes].cpu().numpy().tobytes())

    def pieces(self, ring: BufferRing) -> Iterator[memoryview]:
        import torch

        flat = self._flat()
        pinned = PinnedRing.get(flat.device, ring.chunk_nbytes, self._ring_count)
        step = pinned.chunk_nbytes
        starts = list(range(0, self.nbytes, step))
        count = len(pinned.buffers)
        pinned.stream.wait_stream(torch.cuda.current_stream(flat.device))

        def enqueue(i: int) -> None:
            slot = i % count
            n = min(step, self.nbytes - starts[i])
            with torch.cuda.stream(pinned.stream):
                pinned.buffers[slot][:n].copy_(flat[starts[i] : starts[i] + n], non_blocking=True)
                pinned.events[slot].record(pinned.stream)

        # Two slots stay out of the copy queue: the piece the consumer holds and
        # the one a writer thread may still be writing (writer.write_plan).
        ahead = min(count - 2, len(starts))
        for i in range(ahead):
            enqueue(i)
        timeline = stage_timeline()
        for i in range(len(starts)):
            if i + ahead < len(starts):
                enqueue(i + ahead)
            slot = i % count
            n = min(step, self.nbytes - starts[i])
            if timeline is None:
                pinned.events[slot].synchronize()
            else:
                t = time.perf_counter()
                pinned.events[slot].synchronize()
                timeline.add("D2H wait", time.perf_counter() - t, n)
            # numpy's stubs give ndarray __buffer__ only on Python >= 3.12 (mypy checks 3.10)
            yield memoryview(pinned.buffers[slot].numpy()).cast("B")[:n]  # type: ignore[arg-type]  # see above
        if self._expectation.gpu_fingerprint is not None:
            self._verify(flat, pinned.stream, timeline, self._expectation.gpu_fingerprint)

    def _verify(self, flat: torch.Tensor, stream: torch.cuda.Stream, timeline: StageTimeline | None,
                expected: Fingerprint) -> None:
        """Refuse bytes whose GPU fingerprint is no longer ``expected`` (the one they had when handed over)."""
        import torch

        from .cuda_fingerprint import gpu_fingerprint

        t = time.perf_counter()
        with torch.cuda.stream(stream):
            now = gpu_fingerprint(flat)
        if timeline is not None:
            timeline.add("GPU fingerprint check", time.perf_counter() - t, self.nbytes)
        if now != expected:
            raise IntegrityError(
                f"{self.describe()}: its bytes changed after they were handed to ptdstream "
                f"(GPU fingerprint {now.hex} != {expected.hex}); a tensor kept "
                "for the save must not be modified before the save"
            )
