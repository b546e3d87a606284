"""One copy of the weights through an AOTI backend's lowering, however many methods.

executorch 1.5.1's ``exir/backend/backend_api.py::lower_all_submodules_to_backend``
calls ``copy_exported_program_for_preprocess`` for every method before the
first compiles; ``backends/cuda/cuda_backend.py`` makes it a ``copy.deepcopy``
of the program outside ``low_memory_mode``: one more copy of every weight per
method, on the device where the weights are (GPU or host). Then each method's
``preprocess`` (``backends/aoti/aoti_backend.py``) moves its copy to the device
(``move_to_device_pass`` replaces the state dict's entries; a tensor already
there is kept), compiles it, and ``release_moved_tensors`` resizes every CUDA
storage of the moved program to 0 bytes.

While :func:`sharing_weights` is active for a backend class, its copy shares
the tensors of the program's ``state_dict`` and ``constants`` (a deepcopy with
a memo mapping each to itself, as upstream's ``low_memory_mode`` copy does); the
graph, the signature and the dicts themselves are copied as upstream does, so
what each method's passes replace stays its own. The shared storages are
registered, and the backend's ``release_moved_tensors`` leaves them alone
(it still frees the device copies the move made of host tensors): they are the
caller's weights, intact for every method and after the last one. Nothing the
backend writes out changes: no compile spec is added, and the compile sees the
same tensors (same bytes, devices, shapes, strides and aliasing) as with
upstream's copy. Neither ``preprocess``, its passes nor the AOTI compile write
the program's tensors (mutated buffers are cloned by Inductor's
``_unlift_graph``); the release is the one in-place change, and it is the one
skipped.

:func:`is_shared` tells :mod:`ptdstream.hooks.cuda.keeping` that an AOTI
storage is such a weight, so that it keeps a reference instead of a copy;
:func:`host_weight` names the shared host weight a CUDA storage may be the
device copy of (weights on the host: :mod:`ptdstream.hooks.cuda.hosted`).
Patches go through :func:`ptdstream.upstream.patching.shadowed`.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

from ...upstream.patching import shadowed

__all__ = ["host_weight", "is_shared", "register_shared", "shared_count", "sharing_copy", "sharing_weights",
           "unregister_shared"]

_lock = threading.Lock()
_shared: dict[tuple[str, int], list] = {}  # (device, storage data pointer) -> [contexts, tensor kept alive]
_hosts: dict[str, list] = {}  # FQN -> [contexts, the host tensor, or None when two storages claim it]
_contexts: dict[int, list[list]] = {}  # id(backend) -> the registration lists of its active contexts, oldest first


def _storage_key(tensor: Any) -> tuple[str, int] | None:
    """``(device, storage data pointer)`` of a real tensor with bytes, else ``None``."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        return None
    try:
        ptr = tensor.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - fake, meta or subclass tensors have no storage to share
        return None
    return (str(tensor.device), ptr) if ptr else None


def is_shared(tensor: Any) -> bool:
    """Whether ``tensor``'s storage is a weight shared by an active :func:`sharing_weights` copy."""
    key = _storage_key(tensor)
    with _lock:
        return key is not None and key in _shared


def host_weight(fqn: str) -> Any:
    """The shared host tensor registered under ``fqn`` (a ``state_dict`` or
    ``constants`` key of a program copied inside an active context), or ``None``
    (none, or two different storages under that name)."""
    with _lock:
        entry = _hosts.get(fqn)
        return entry[1] if entry is not None else None


def shared_count() -> int:
    """Storages registered as shared (across active contexts)."""
    with _lock:
        return len(_shared)


def _program_tensors(program: Any) -> list[tuple[str, Any]]:
    import torch

    return [(k, t) for values in (program.state_dict, program.constants) for k, t in values.items()
            if isinstance(t, torch.Tensor)]


def sharing_copy(program: Any, registered: list) -> Any:
    """``copy.deepcopy(program)`` sharing its ``state_dict`` and ``constants`` tensors.

    Registers each shared tensor's storage (see :func:`is_shared`) and each
    host one by name (see :func:`host_weight`), and appends what it registered
    to ``registered`` (the caller unregisters them).
    """
    return _sharing_copy(program, lambda: registered)


def _sharing_copy(program: Any, owner: Callable[[], list | None]) -> Any:
    """:func:`sharing_copy` into the list ``owner()`` gives (called under the
    registry's lock); ``None`` and nothing registered when it gives ``None``."""
    tensors = _program_tensors(program)
    with _lock:
        registered = owner()
        if registered is None:
            return None
        for fqn, t in tensors:
            key = _storage_key(t)
            if key is None:
                continue
            entry = _shared.setdefault(key, [0, t])
            entry[0] += 1
            registered.append(key)
            if key[0] == "cpu":
                host = _hosts.setdefault(fqn, [0, t])
                if host[1] is not None and _storage_key(host[1]) != key:
                    host[1] = None  # two storages under one name: serve neither from the host
                host[0] += 1
                registered.append(fqn)
    return copy.deepcopy(program, {id(t): t for _, t in tensors})


def register_shared(tensor: Any, registered: list) -> None:
    """Register ``tensor``'s storage as a shared weight (:func:`is_shared`; kept
    alive) until :func:`unregister_shared` of ``registered``, to which its key is
    appended. A tensor without a real storage is ignored."""
    key = _storage_key(tensor)
    if key is None:
        return
    with _lock:
        entry = _shared.setdefault(key, [0, tensor])
        entry[0] += 1
    registered.append(key)


def unregister_shared(registered: list) -> None:
    """Release every registration listed in ``registered`` (then cleared)."""
    _unregister(registered)


def _unregister(registered: list) -> None:
    with _lock:
        _release(registered)


def _release(registered: list) -> None:
    """Release ``registered``'s registrations (then cleared); the caller holds ``_lock``."""
    for key in registered:
        table: dict = _hosts if isinstance(key, str) else _shared
        entry = table.get(key)
        if entry is None:
            continue
        entry[0] -= 1
        if entry[0] <= 0:
            del table[key]
    registered.clear()


def _without_shared(program: Any) -> types.SimpleNamespace:
    """The ``state_dict`` and ``constants`` of ``program`` less the shared tensors
    (what ``release_moved_tensors`` reads)."""
    state_dict = getattr(program, "state_dict", None) or {}
    constants = getattr(program, "constants", None) or {}
    return types.SimpleNamespace(
        state_dict={k: v for k, v in state_dict.items() if not is_shared(v)},
        constants={k: v for k, v in constants.items() if not is_shared(v)},
    )


@contextlib.contextmanager
def sharing_weights(backend: Any) -> Iterator[None]:
    """While active, ``backend``'s per-method copies share the program's weights.

    ``backend`` is an executorch ``BackendDetails`` subclass with
    ``copy_exported_program_for_preprocess`` and ``release_moved_tensors``
    classmethods (executorch's ``CudaBackend``; any ``AotiBackend``). Both are
    replaced while a context is active and restored when the last one exits.
    A copy's registrations belong to the newest context for ``backend`` active
    when it is made, and are released from the registry when that context
    exits (the tensors themselves are not touched): contexts may exit in any
    order, and once every one has exited none remains. Thread-safe; lower one
    model at a time.
    """
    release = backend.release_moved_tensors
    upstream_copy = backend.copy_exported_program_for_preprocess
    owner = id(backend)
    registered: list = []

    def newest() -> list | None:
        lists = _contexts.get(owner)
        return lists[-1] if lists else None

    def copy_for_preprocess(cls, edge_program, compile_specs):
        # the one installed patch (the first context's) serves every context for backend
        copied = _sharing_copy(edge_program, newest)
        return upstream_copy(edge_program, compile_specs) if copied is None else copied

    def release_moved_tensors(cls, device_edge_program, compile_specs):
        return release(_without_shared(device_edge_program), compile_specs)

    with _lock:
        _contexts.setdefault(owner, []).append(registered)
    try:
        with shadowed(backend, "copy_exported_program_for_preprocess", classmethod(copy_for_preprocess)), \
                shadowed(backend, "release_moved_tensors", classmethod(release_moved_tensors)):
            yield
    finally:
        with _lock:
            lists = [r for r in _contexts.get(owner, []) if r is not registered]
            if lists:
                _contexts[owner] = lists
            else:
                _contexts.pop(owner, None)
            _release(registered)
