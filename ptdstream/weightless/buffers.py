"""A module's large buffers moved to files while it is exported: the static KV cache.

An exportable decoder (transformers' ``TorchExportableModuleWithStaticCache``,
optimum's custom caches) registers its KV cache as buffers: zeros of
``(batch, kv heads, max_seq_len, head dim)`` per layer and key/value, in the
model's dtype (8 MiB a layer at optimum's defaults for 4 KV heads of 128 in
float32), made in anonymous memory before ``torch.export`` runs, and a strict
export copies each into dynamo's real-value cache (``_clone_input``). Neither
the values nor the copies are ever needed: the export traces fake tensors, a
mutated buffer is memory-planned and its bytes are not serialized, and a
buffer that is not mutated is read once, by the emitter.

:func:`move_large_buffers` writes each buffer of at least :data:`MOVE_NBYTES`
to a nameless file of the context's folder
(:func:`~ptdstream.weightless.mapped_copy.mapped_copy`) and re-points every
tensor over its storage at the file's shared, writable mapping in place
(``Tensor.set_``: the cache object and the module keep the same tensor
objects), so the anonymous memory is freed and the pages tracing reads are
dropped with the other files of the context
(:meth:`~ptdstream.weightless.WeightsFrom.release_file_pages`). A storage that
other tensors share beyond the module's buffers (a view held elsewhere) is
left as it is: re-pointing only some of them would part their values.
"""

from __future__ import annotations

from typing import Any

from ..system.pagecache import file_mapping
from ..upstream import adapter
from .mapped_copy import mapped_copy
from .storage_less import is_storage_less

__all__ = ["MOVE_NBYTES", "move_large_buffers"]

#: A buffer's storage this large (bytes) or larger is moved to a file.
MOVE_NBYTES = 1 << 20


def move_large_buffers(module: Any, folder: str) -> list[Any]:
    """Move each CPU buffer of ``module`` whose storage holds at least
    :data:`MOVE_NBYTES` bytes to a nameless file in ``folder``, in place (values,
    dtype, shape, strides and storage offset unchanged; see the module docstring).
    Skipped: storage-less buffers, tensor subclasses, storages already backed by a
    file (a mapped checkpoint, a quantized weight), storages shared with tensors
    that are not the module's buffers. Returns the new storages (the caller keeps
    them, to know them by address).

    Raises:
        OSError: a file could not be created, written or mapped (names ``folder``).
    """
    import torch

    groups: dict[int, dict[int, Any]] = {}  # storage address -> {id(tensor): tensor}
    for _, buffer in module.named_buffers(remove_duplicate=False):
        if type(buffer) is not torch.Tensor or buffer.device.type != "cpu" or buffer.is_nested \
                or is_storage_less(buffer):
            continue
        storage = buffer.untyped_storage()
        if storage.nbytes() >= MOVE_NBYTES:
            groups.setdefault(storage.data_ptr(), {})[id(buffer)] = buffer
    moved = []
    for address, tensors in groups.items():
        first = next(iter(tensors.values()))
        storage = first.untyped_storage()
        if file_mapping(address, storage.nbytes()) is not None:
            continue
        if adapter.storage_use_count(storage) != len(tensors) + 1:  # + the wrapper held here
            continue
        copy = mapped_copy(first, folder).untyped_storage()
        with torch.no_grad():
            for tensor in tensors.values():
                tensor.set_(copy, tensor.storage_offset(), tensor.shape, tensor.stride())
        moved.append(copy)
    return moved
