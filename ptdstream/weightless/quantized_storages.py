"""Which checkpoint key each quantized tensor made inside a context comes from.

torchao's ``quantize_`` run inside :func:`~ptdstream.weightless.weights_from`
(:mod:`ptdstream.weightless.quantization`) leaves a quantized tensor subclass on
each module it picks; ``unwrap_tensor_subclass`` then replaces it by plain
parameters that share its inner tensors' storages (``qdata``, ``scale``,
``zero_point``), and ``torch.export`` lifts those as constants. A program's
constant is matched to its checkpoint key by its storage: (device type, data
pointer) of a non-empty storage, the key of the weight it was quantized from.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..upstream import adapter
from .storage_less import inner_tensors, is_storage_less

__all__ = ["QuantizedStorages"]


class QuantizedStorages:
    """The storages of the quantized tensors one context made, each to its
    checkpoint key; ``keys`` lists those keys in the order they were quantized.
    The tensors recorded are kept alive (a storage's address stays its own)."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self._by_storage: dict[tuple[str, int], str] = {}
        self._kept: list[Any] = []

    def note(self, key: str, weight: Any) -> list[Any]:
        """Record ``weight`` (a torchao quantized tensor subclass) as made from
        checkpoint key ``key``; returns its inner tensors (the caller registers
        them as bound, for XNNPACK's copy)."""
        self._kept.append(weight)
        inner = inner_tensors(weight)
        for tensor in inner:
            storage = tensor.untyped_storage()
            if storage.nbytes():
                self._by_storage[tensor.device.type, storage.data_ptr()] = key
        if key not in self.keys:
            self.keys.append(key)
        return inner

    def key_of(self, tensor: Any) -> str | None:
        """The key recorded for plain tensor ``tensor``'s storage (None: not one of
        these storages, an empty storage, or a tensor subclass)."""
        if not self._by_storage or adapter.is_traceable_wrapper_subclass(tensor):
            return None
        storage = tensor.untyped_storage()
        return self._by_storage.get((tensor.device.type, storage.data_ptr())) if storage.nbytes() else None

    def adopt(self, programs: Mapping[str, Any], origins: dict[int, str]) -> list[Any]:
        """Match the constants of ``programs`` (``{method: ExportedProgram}``) not
        yet in ``origins`` (``id(tensor) -> key``, updated in place) and not
        storage-less: a plain tensor sharing a recorded storage takes its key, and
        so does a tensor subclass kept whole (the CUDA backend's int4, no
        ``unwrap_tensor_subclass``) whose inner tensors all have one key. Returns
        the plain tensors matched (the caller registers them as bound)."""
        matched: list[Any] = []
        if not self._by_storage:
            return matched
        for ep in programs.values():
            for table in ("state_dict", "constants"):
                for tensor in getattr(ep, table).values():
                    if id(tensor) in origins or is_storage_less(tensor):
                        continue
                    if adapter.is_traceable_wrapper_subclass(tensor):
                        keys = {k for k in map(self.key_of, inner_tensors(tensor)) if k is not None}
                        if len(keys) == 1:
                            origins[id(tensor)] = keys.pop()
                        continue
                    key = self.key_of(tensor)
                    if key is not None:
                        matched.append(tensor)
                        origins[id(tensor)] = key
        return matched
