"""CPU tensor sources: a tensor's bytes read in place from its storage."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import IntegrityError, LayoutError
from .base import BufferRing, Source, digest_view
from .digest import Fingerprint

if TYPE_CHECKING:
    import torch

__all__ = ["TensorSource", "check_storage"]


def check_storage(tensor: torch.Tensor, start_nbytes: int, nbytes: int, what: str) -> None:
    """Refuse a tensor whose storage no longer holds ``[start_nbytes, start_nbytes +
    nbytes)`` (freed or resized after the tensor was handed over).

    Raises:
        IntegrityError: naming ``what`` and both sizes in bytes.
    """
    storage = tensor.untyped_storage()
    needed = start_nbytes + nbytes
    if storage.nbytes() < needed:
        raise IntegrityError(
            f"{what}: its storage holds {storage.nbytes()} bytes, "
            f"{needed} needed; was it freed or resized after it was added?"
        )


class TensorSource(Source):
    """A CPU tensor's bytes, read in place from its storage (no copy, bf16 included).

    The bytes are those upstream's ``_named_data_store._tensor_to_bytes`` gives:
    the tensor's elements in memory order. A contiguous tensor (any storage
    offset) is viewed directly. A non-contiguous tensor is accepted only when it
    is dense and fills its whole storage from offset 0 (``channels_last``, for
    example): upstream writes the whole storage for those, and so does this
    source. Other non-contiguous tensors (slices, expanded views) raise, since
    upstream would write the whole underlying storage, not the tensor.

    Raises:
        LayoutError: a non-contiguous tensor that is not dense over its whole
            storage ("call .contiguous()").
        IntegrityError: at write time, when the storage was freed or resized
            after the tensor was added, or its bytes differ from those digested
            when it was handed over (:meth:`~ptdstream.sources.base.Source.hand_over`:
            the caller may write to a tensor, so it is digested then).
    """

    def __init__(self, tensor: torch.Tensor, label: str = "tensor") -> None:
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"{label}: expected a torch.Tensor, got {type(tensor)}")
        if tensor.device.type != "cpu":
            raise LayoutError(
                f"{label}: tensor is on {tensor.device}; use ptdstream.sources.cuda.CudaTensorSource"
            )
        self._tensor = tensor.detach()
        self._label = label
        self._whole_storage = not self._tensor.is_contiguous()
        if self._whole_storage and not _fills_storage(self._tensor):
            raise LayoutError(
                f"{label}: tensor with shape {tuple(tensor.shape)} and strides "
                f"{tuple(tensor.stride())} is not contiguous; call .contiguous() on it "
                "before adding it"
            )
        self.nbytes = self._expected_nbytes()

    def _expected_nbytes(self) -> int:
        if self._whole_storage:
            return self._tensor.untyped_storage().nbytes()
        return self._tensor.numel() * self._tensor.element_size()

    def describe(self) -> str:
        t = self._tensor
        return f"{self._label} {str(t.dtype).replace('torch.', '')}{list(t.shape)}"

    def _view(self) -> memoryview:
        """A read-only view of the bytes, made from the storage's address.

        ``Tensor.numpy()`` would mark the caller's storage non-resizable for good;
        a ctypes view does not. The tensor reference held by this source keeps
        the storage alive; its size is checked here, right before reading.
        """
        import ctypes

        check_storage(self._tensor, self._start(), self.nbytes, self.describe())
        if self.nbytes == 0:
            return memoryview(b"")
        array = (ctypes.c_ubyte * self.nbytes).from_address(self._address())
        return memoryview(array).cast("B").toreadonly()

    def _start(self) -> int:
        """Offset (bytes) of the first byte in the storage."""
        t = self._tensor
        return 0 if self._whole_storage else int(t.storage_offset()) * t.element_size()

    def _address(self) -> int:
        """Address of the first byte, where the storage is now."""
        return self._tensor.untyped_storage().data_ptr() + self._start()

    def view(self) -> memoryview:
        """The bytes, in place (read-only).

        Raises:
            IntegrityError: the storage was freed or resized.
        """
        return self._view()

    def _digest_at_hand_over(self) -> Fingerprint:
        return digest_view(self._view())

    def prefix(self, nbytes: int = 32) -> bytes:
        return bytes(self._view()[:nbytes])

    def pieces(self, ring: BufferRing) -> Iterator[memoryview]:
        view = self._view()
        step = ring.chunk_nbytes
        for start in range(0, self.nbytes, step):
            yield view[start : start + step]


def _fills_storage(t: torch.Tensor) -> bool:
    if t.storage_offset() != 0:
        return False
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return False
    # Dense and non-overlapping: sorting the strides must give a contiguous layout.
    dims = sorted(range(t.dim()), key=lambda d: t.stride(d))
    expected = 1
    for d in dims:
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True
