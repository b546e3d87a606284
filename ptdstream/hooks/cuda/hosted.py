"""AOTI storages that are the device copies of shared host weights, served from the host.

With the weights on the host, each method's ``preprocess``
(``backends/aoti/aoti_backend.py``) moves its program to the GPU
(``move_to_device_pass``: ``tensor.to("cuda")``), the AOTI compile hands those
CUDA tensors to the weight collector, and ``release_moved_tensors`` frees them
after the method. The model's parameters are on the host, so no CUDA twin holds
the bytes. While :func:`~ptdstream.hooks.cuda.sharing.sharing_weights` is
active, the program's host weights are known by FQN
(:func:`~ptdstream.hooks.cuda.sharing.host_weight`); a CUDA storage whose FQN
names one with exactly its bytes is served from that host tensor
(:class:`HostWeightSource`): no device copy kept, nothing spilled, and the save
reads the bytes in place from host memory.

Equality is proven, not assumed: the host bytes are copied to the device in
pieces of :data:`COMPARE_NBYTES` and compared exactly with the storage
(:func:`~ptdstream.hooks.cuda.twins.same_bytes`), once per distinct storage; the
host bytes are digested (xxh3-128) at the same time they are handed over, and
the save refuses bytes changed since (naming the key).
"""

from __future__ import annotations

from typing import Any

from ...sources.base import Expectation
from ...sources.digest import Fingerprint
from ...sources.tensor import TensorSource
from .twins import same_bytes

__all__ = ["COMPARE_NBYTES", "HostWeightSource", "equal_to_host"]

#: Bytes of each host piece copied to the device for the comparison (the device memory it adds).
COMPARE_NBYTES = 64 << 20


class HostWeightSource(TensorSource):
    """A host tensor's bytes standing for an AOTI CUDA storage with the same bytes.

    Args:
        tensor: the host weight (contiguous, from storage offset 0, filling its storage).
        label: what it is, for error messages.
        gpu_fingerprint: the CUDA storage's GPU fingerprint (the key upstream
            dedups by; later methods' storages are matched by it).

    The bytes are digested (xxh3-128) when made: the save refuses them if they
    changed since (``IntegrityError`` naming the key).
    """

    def __init__(self, tensor: Any, label: str, gpu_fingerprint: Fingerprint) -> None:
        super().__init__(tensor, label=label)
        self._expectation = Expectation(gpu_fingerprint=gpu_fingerprint)
        self.hand_over()

    def gpu_fingerprint(self) -> Fingerprint | None:
        """The CUDA storage's GPU fingerprint, as taken when this source was made."""
        return self._expectation.gpu_fingerprint


def equal_to_host(host: Any, flat: Any, compare_nbytes: int = COMPARE_NBYTES) -> bool:
    """Whether the host tensor ``host`` fills its storage with exactly the bytes of
    ``flat`` (a 1-D ``uint8`` tensor on any device): copied over in pieces of
    ``compare_nbytes`` bytes and compared exactly. ``False`` for a host tensor
    that is not contiguous, starts past offset 0, or has another number of bytes.
    """
    import torch

    if host.device.type != "cpu" or not host.is_contiguous() or host.storage_offset() != 0:
        return False
    nbytes = host.numel() * host.element_size()
    if nbytes != flat.numel() or host.untyped_storage().nbytes() != nbytes:
        return False
    if nbytes == 0:
        return True
    src = host.detach().reshape(-1).view(torch.uint8)
    for start in range(0, nbytes, compare_nbytes):
        end = min(start + compare_nbytes, nbytes)
        if not same_bytes(src[start:end].to(flat.device), flat[start:end]):
            return False
    return True
