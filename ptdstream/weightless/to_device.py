"""Bound checkpoint weights loaded straight from their file to the CUDA device: no host copy.

executorch 1.5.1's AOTI backends move each method's program to the device
before compiling it: ``backends/aoti/aoti_backend.py::preprocess`` calls
``move_program_to_device``, which ``backends/cuda/cuda_backend.py`` routes to
``torch.export.passes.move_to_device_pass`` (``tensor.to("cuda")`` for every
``state_dict`` and ``constants`` entry). Inside
:func:`~ptdstream.weightless.weights_from` the bound constants are views of the
checkpoint's file mapping, so ``.to("cuda")`` would fault in every page of it
(file-backed RSS, kept while mapped), and upstream's per-method
``copy.deepcopy`` (``copy_exported_program_for_preprocess``) would copy each
one into host memory before that. While :func:`loading_to_device` is active
for a backend class:

1) its per-method copies share the program's weights
   (:func:`ptdstream.hooks.cuda.sharing.sharing_weights`: the same program,
   the same compiled output, no host copy);
2) its ``move_program_to_device`` first replaces each bound constant of the
   program being moved by a device tensor loaded from the checkpoint file
   (:func:`load_to_device`), then runs upstream's move, which keeps a tensor
   already on the device;
3) each device copy is made once, by the first method that moves its FQN, and
   later methods' moves of that FQN get the same tensor: it is registered as
   a shared weight (:func:`~ptdstream.hooks.cuda.sharing.register_shared`), which
   the backend's ``release_moved_tensors`` leaves alone and
   :func:`~ptdstream.stream_cuda_weights` keeps by reference (its save reads it
   from the GPU). So the GPU holds one copy of the bound weights from the first
   method on (plus each method's compile workspace), as with the weights on the
   GPU, and the host holds none: the route never reaches
   :mod:`ptdstream.hooks.cuda.hosted`, whose comparison and digest would read
   the whole mapping. Two FQNs of one tensor (tied weights) get a copy each
   within a method, as ``.to`` gives them. The registrations end when the
   context exits; tensors the manager still holds stay valid.

Loading (:mod:`ptdstream.weightless.device_load`): the tensor's file range read
with ``preadv`` into the reused pinned ring, an asynchronous host-to-device copy
per piece, pages dropped behind, a conversion per piece for another dtype, the
file's identity checked before and after; see there. The bound constants are
views of a copy-on-write (``MAP_PRIVATE``) mapping, writable: one written in
place since it was bound (a pass, or the user editing ``ep.state_dict``: a
page of its range is a private copy, per
:func:`~ptdstream.system.pagecache.private_copies`; or ``/proc/self/pagemap``
cannot be read) is loaded from its own memory (its mapping, each piece paged
out), so the device holds the bytes the tensor has, as ``.to`` would copy;
a write while it is read from the file is refused (see there). An empty or
non-dense bound constant is left to upstream's ``.to`` (listed in
``DeviceLoadStats.left_to_upstream``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..defaults import CHUNK_NBYTES
from ..hooks.cuda.sharing import register_shared, sharing_weights, unregister_shared
from ..sources.base import FileIdentity
from ..sources.mapped import MappedTensorSource
from ..system.pagecache import file_mapping, private_copies
from ..upstream import adapter
from ..upstream.patching import shadowed
from .device_load import DeviceLoad, HostStaging, PinnedStaging, itemsize, load_to_device

__all__ = ["DeviceLoadStats", "DeviceLoads", "loading_bound_to_device", "loading_to_device"]

_lock = threading.Lock()
_active: list[DeviceLoads] = []  # the open contexts' loads, consulted by the patched move
_load_lock = threading.Lock()  # one load at a time through a process-wide staging ring


def _dense(tensor: Any) -> bool:
    """Non-overlapping and dense: its elements fill one byte range (``.to`` keeps its strides)."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _view(tensor: Any) -> tuple | None:
    """What identifies a view of real memory: storage address, offset, dtype, shape, strides."""
    try:
        ptr = tensor.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - fake, meta or subclass tensors have no storage
        return None
    if not ptr:
        return None
    return (ptr, tensor.storage_offset(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


@dataclass
class DeviceLoadStats:
    """What :class:`DeviceLoads` did: ``loaded`` device copies made (``loaded_nbytes``
    on the device, ``read_nbytes`` read from the checkpoint; ``converted`` of them
    from another dtype), ``reused``: moves of a later method served by a copy
    already made, ``left_to_upstream``: ``"table fqn"`` of bound constants moved by
    upstream's ``.to`` (empty, not dense, or in no file or mapping)."""

    loaded: int = 0
    loaded_nbytes: int = 0
    read_nbytes: int = 0
    converted: int = 0
    reused: int = 0
    left_to_upstream: list[str] = field(default_factory=list)


class DeviceLoads:
    """The bound constants of one weights_from context and the device copies made of them.

    ``checkpoint``: the context's :class:`~ptdstream.sources.checkpoint_base.Checkpoint`;
    ``identities``: each of its files -> its identity when the context opened it;
    ``staging``: device -> the staging ring to load through (default: the
    pinned ring of a CUDA device, a :class:`HostStaging` for another).
    :meth:`add` as each key is bound; :meth:`device_copy` from the patched move;
    :meth:`close` at the context's exit. Not thread-safe: one lowering at a time.
    """

    def __init__(self, checkpoint: Any, identities: Mapping[str, FileIdentity | None],
                 staging: Callable[[Any], HostStaging] | None = None, chunk_nbytes: int = CHUNK_NBYTES) -> None:
        self.checkpoint = checkpoint
        self.identities = identities
        self.chunk_nbytes = chunk_nbytes
        self._staging = staging
        self._bound: dict[tuple, tuple[str, Any]] = {}  # view -> (checkpoint key, bound tensor)
        self._copies: dict[tuple, Any] = {}  # (table, fqn, key, dtype, shape, strides, device) -> its copy
        self._registered: list = []
        self.stats = DeviceLoadStats()

    def add(self, key: str, tensor: Any) -> None:
        """Record ``tensor`` (the one bound for checkpoint ``key``: its mapped view or converted copy)."""
        view = _view(tensor)
        if view is not None:
            self._bound[view] = (key, tensor)

    def staging_for(self, device: Any) -> HostStaging:
        """The staging ring to load into ``device`` through: the context's, else the pinned ring of a CUDA device or
        a :class:`HostStaging`."""
        if self._staging is not None:
            return self._staging(device)
        if device.type == "cuda":
            return PinnedStaging.get(device, self.chunk_nbytes)
        return HostStaging(self.chunk_nbytes, device=str(device))

    def plan(self, key: str, bound: Any) -> DeviceLoad | None:
        """How ``bound`` (bound for ``key``) is loaded, or None: left to upstream's ``.to``."""
        if bound.numel() == 0 or not _dense(bound):
            return None
        entry = self.checkpoint.entries[key]
        label = f"{entry.where}: key {key!r}"
        shape, stride = tuple(bound.shape), tuple(bound.stride())
        memory = (bound.data_ptr(), bound.numel() * bound.element_size())
        if private_copies(*memory) is not False:  # written in place (or unknown): its memory, as .to reads
            return self._from_memory(label, bound, read_file=False)
        if self.checkpoint.kind in ("safetensors", "torch") and key not in self.checkpoint.derived:
            source = self.checkpoint.source(key)
            view = self.checkpoint.tensor(key)
            identity = self.identities.get(entry.where)
            if (isinstance(source, MappedTensorSource) and source.read_file and identity is not None
                    and source.mapping.inode == identity.inode and _dense(view) and tuple(view.stride()) == stride):
                offset = source.mapping.offset + (view.data_ptr() - source.mapping.start)
                return DeviceLoad(label, shape, stride, bound.dtype, path=entry.where, offset=offset,
                                  stored=entry.dtype, identity=identity, memory=memory)
            if entry.dtype == bound.dtype and view is bound:
                return DeviceLoad(label, shape, stride, bound.dtype, source=source,
                                  memory=memory)  # the mapping, paged out
        return self._from_memory(label, bound)

    @staticmethod
    def _from_memory(label: str, bound: Any, read_file: bool | None = None) -> DeviceLoad | None:
        """A load of ``bound``'s own mapping (``read_file``: as
        :class:`~ptdstream.sources.mapped.MappedTensorSource`), or None: in no mapping."""
        storage = bound.untyped_storage()
        mapping = file_mapping(storage.data_ptr(), storage.nbytes())
        if mapping is None:
            return None
        source = MappedTensorSource(bound, mapping, label, read_file=read_file)
        return DeviceLoad(label, tuple(bound.shape), tuple(bound.stride()), bound.dtype, source=source)

    def device_copy(self, table: str, fqn: str, tensor: Any, device: Any) -> Any:
        """The device copy of ``tensor`` (``table``'s ``fqn`` of a program being
        moved to ``device``), made now or by an earlier method; None when it is
        not one of this context's bound tensors, or is left to upstream."""
        view = _view(tensor)
        if view is None or view not in self._bound:
            return None
        key, bound = self._bound[view]
        # By checkpoint key, not by view: a key stored in another dtype is converted
        # anew for each method's program (another view of the same bytes).
        cached = (table, fqn, key, bound.dtype, tuple(bound.shape), tuple(bound.stride()), str(device))
        if cached in self._copies:
            self.stats.reused += 1
            return self._copies[cached]
        load = self.plan(key, bound)
        if load is None:
            self.stats.left_to_upstream.append(f"{table} {fqn}")
            return None
        with _load_lock:
            copy = load_to_device(load, self.staging_for(device))
        register_shared(copy, self._registered)
        self._copies[cached] = copy
        self.stats.loaded += 1
        self.stats.loaded_nbytes += copy.numel() * copy.element_size()
        self.stats.read_nbytes += copy.numel() * itemsize(load.stored if load.stored is not None else load.dtype)
        self.stats.converted += load.stored is not None and load.stored != load.dtype
        return copy

    def close(self) -> None:
        """Forget the copies and end their registration as shared weights (idempotent)."""
        self._copies.clear()
        unregister_shared(self._registered)


def _load_bound(program: Any, device: Any) -> None:
    """Replace each bound constant of ``program`` by its device copy (see :class:`DeviceLoads`)."""
    import torch

    target = torch.device(device)
    if target.type == "cpu":
        return  # upstream's .to("cpu") keeps them: nothing read
    with _lock:
        loads = list(_active)
    for table in ("state_dict", "constants"):
        values = getattr(program, table, None) or {}
        for fqn, tensor in list(values.items()):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            for owner in loads:
                copy = owner.device_copy(table, fqn, tensor, target)
                if copy is not None:
                    values[fqn] = (torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
                                   if isinstance(tensor, torch.nn.Parameter) else copy)
                    break


@contextlib.contextmanager
def loading_to_device(loads: DeviceLoads, backend: Any) -> Iterator[DeviceLoads]:
    """While active, ``backend`` (executorch's ``CudaBackend``, or any class with
    its ``copy_exported_program_for_preprocess``, ``release_moved_tensors`` and
    ``move_program_to_device`` classmethods) shares the program's weights among
    its per-method copies and loads ``loads``' bound constants from the
    checkpoint to the device when it moves a program (see the module docstring).
    The three are restored when the last context exits
    (:func:`ptdstream.upstream.patching.shadowed`); ``loads`` is closed at exit.
    Thread-safe; lower one model at a time."""
    move = backend.move_program_to_device

    def move_program_to_device(cls, edge_program, device, compile_specs):
        _load_bound(edge_program, device)
        return move(edge_program, device, compile_specs)

    with _lock:
        _active.append(loads)
    try:
        with sharing_weights(backend), \
                shadowed(backend, "move_program_to_device", classmethod(move_program_to_device)):
            yield loads
    finally:
        with _lock:
            _active.remove(loads)
        loads.close()


def loading_bound_to_device(loads: DeviceLoads) -> contextlib.AbstractContextManager[Any]:
    """:func:`loading_to_device` for executorch's ``CudaBackend``; a context that
    does nothing when that backend is not importable (no triton, no CUDA build)."""
    try:
        backend = adapter.cuda_backend()
    except ImportError:
        return contextlib.nullcontext(loads)
    return loading_to_device(loads, backend)
