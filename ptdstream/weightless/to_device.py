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

:func:`load_to_device` reads the tensor's file range with ``preadv`` into the
reused pinned host ring (:class:`~ptdstream.sources.cuda.PinnedRing`, 4 x 8 MiB,
one per device for the process) and copies each piece asynchronously to its
slice of the new device tensor on the ring's stream while the next piece is
read; each piece's pages are dropped behind the read
(:func:`~ptdstream.system.pagecache.drop_read`): every weight is read once (its
device copy serves every method and the save), so cached pages would only fill
the page cache. A key stored in another float dtype is converted per piece on
the host into the pinned buffer, with the copy kernel
:mod:`ptdstream.weightless.convert` uses (element by element: the same bytes as
the converted copy the binding made). A bound tensor the file cannot give
directly (a ``torch.save`` archive of the other byte order; a DCP tensor's
converted copy) is read through its mapping, each piece paged out
(:class:`~ptdstream.sources.mapped.MappedTensorSource`). An empty or non-dense
bound constant is left to upstream's ``.to`` (listed in
``DeviceLoadStats.left_to_upstream``). The device tensor has the bound tensor's
dtype, shape and strides, storage offset 0: the bytes of ``bound.to(device)``.

Checks: the checkpoint file's identity (device, inode, size, modification and
change time) when the context opened it, compared with the open file's before
and after each tensor is read, and every read's length: ``IntegrityError``
naming the file, the key and (short read) the offset; nothing is left on the
device by a failed load.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..defaults import CHUNK_NBYTES
from ..errors import IntegrityError
from ..hooks.cuda.sharing import register_shared, sharing_weights, unregister_shared
from ..sources.base import BufferRing, FileIdentity, Source
from ..sources.mapped import MappedTensorSource
from ..system.files import pread_exact
from ..system.pagecache import drop_read, file_mapping
from ..upstream import adapter
from ..upstream.patching import shadowed

__all__ = ["DeviceLoad", "DeviceLoadStats", "DeviceLoads", "HostStaging", "PinnedStaging", "load_to_device",
           "loading_bound_to_device", "loading_to_device"]

_lock = threading.Lock()
_active: list[DeviceLoads] = []  # the open contexts' loads, consulted by the patched move
_load_lock = threading.Lock()  # one load at a time through a process-wide staging ring
_stagings: dict[tuple[str, int], PinnedStaging] = {}


class HostStaging:
    """The staging ring's interface over plain host buffers, with synchronous
    copies to tensors made on ``device`` (a CPU target; a test's stand-in for
    :class:`PinnedStaging`). ``count`` buffers of ``chunk_nbytes`` bytes."""

    def __init__(self, chunk_nbytes: int = CHUNK_NBYTES, count: int = 2, device: str = "cpu") -> None:
        import torch

        self.chunk_nbytes = chunk_nbytes
        self.device = torch.device(device)
        self.buffers = [torch.empty(chunk_nbytes, dtype=torch.uint8) for _ in range(count)]

    def empty(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: Any) -> Any:
        """The destination tensor (uninitialized)."""
        import torch

        return torch.empty_strided(shape, stride, dtype=dtype, device=self.device)

    def slot(self, i: int) -> Any:
        """Buffer of piece ``i``, free to be filled."""
        return self.buffers[i % len(self.buffers)]

    def send(self, i: int, dst: Any, nbytes: int) -> None:
        """Copy the first ``nbytes`` of piece ``i``'s buffer into ``dst`` (1-D uint8)."""
        dst.copy_(self.slot(i)[:nbytes])

    def start(self) -> None:
        """Before the first piece of a tensor."""

    def finish(self) -> None:
        """After the last piece: every copy complete."""


class PinnedStaging(HostStaging):
    """:class:`~ptdstream.sources.cuda.PinnedRing` buffers (pinned, ``count`` x
    ``chunk_nbytes``) and its stream: each piece's host-to-device copy is queued
    on the ring's stream, and a buffer is refilled only once its last copy is done."""

    def __init__(self, device: Any, chunk_nbytes: int = CHUNK_NBYTES, count: int = 4) -> None:
        from ..sources.cuda import PinnedRing

        self.chunk_nbytes = chunk_nbytes
        self.device = device
        self.ring = PinnedRing(device, chunk_nbytes, count)
        self.buffers = self.ring.buffers

    @staticmethod
    def get(device: Any, chunk_nbytes: int = CHUNK_NBYTES) -> PinnedStaging:
        """The process's staging ring for ``device`` (made once, never freed)."""
        key = (str(device), chunk_nbytes)
        with _lock:
            if key not in _stagings:
                _stagings[key] = PinnedStaging(device, chunk_nbytes)
            return _stagings[key]

    def slot(self, i: int) -> Any:
        s = i % len(self.buffers)
        self.ring.events[s].synchronize()  # its previous copy (an event never recorded returns at once)
        return self.buffers[s]

    def send(self, i: int, dst: Any, nbytes: int) -> None:
        import torch

        s = i % len(self.buffers)
        with torch.cuda.stream(self.ring.stream):
            dst.copy_(self.buffers[s][:nbytes], non_blocking=True)
            self.ring.events[s].record(self.ring.stream)

    def start(self) -> None:
        import torch

        self.ring.stream.wait_stream(torch.cuda.current_stream(self.device))  # the destination's allocation

    def finish(self) -> None:
        self.ring.stream.synchronize()


@dataclass(frozen=True)
class DeviceLoad:
    """Where one bound constant's bytes are, and the device tensor to make.

    ``shape``, ``stride`` (elements, dense) and ``dtype``: the device tensor's
    (the bound tensor's). Read from ``path`` at file ``offset`` (bytes; the
    tensor stored there as ``stored``, converted per piece when it differs from
    ``dtype``; ``identity``: the file's when the context opened it), or else
    from ``source``'s pieces (already in ``dtype``). ``label`` names file and key.
    """

    label: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any
    path: str | None = None
    offset: int = 0
    stored: Any = None
    identity: FileIdentity | None = None
    source: Source | None = None


def _itemsize(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _host_view(tensor: Any) -> memoryview:
    """A writable byte view of a host uint8 tensor."""
    return memoryview(tensor.numpy()).cast("B")


def _check_identity(fd: int, load: DeviceLoad, when: str) -> None:
    now = FileIdentity.of(os.fstat(fd))
    if load.identity is not None and now != load.identity:
        raise IntegrityError(
            f"{load.label}: checkpoint file {load.path} changed after weights_from opened it (device, inode, size, "
            f"modification and change time {tuple(load.identity)} then, {tuple(now)} now), {when}, when it was "
            "loaded to the device: nothing loaded; a checkpoint must not change until the save: export again "
            "from an unchanged checkpoint")


def _file_pieces(load: DeviceLoad, path: str, staging: HostStaging) -> Iterator[tuple[int, int]]:
    """Fill staging slot ``i`` with piece ``i`` of ``path`` (converted) and yield ``(i, nbytes)``."""
    stored = load.stored if load.stored is not None else load.dtype
    size_in, size_out = _itemsize(stored), _itemsize(load.dtype)
    numel = _numel(load.shape)
    per = max(1, staging.chunk_nbytes // max(size_in, size_out))  # elements per piece
    convert = stored != load.dtype
    scratch = None
    if convert:
        import torch

        scratch = torch.empty(per * size_in, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        _check_identity(fd, load, "before it was read")
        done, i = 0, 0
        while done < numel:
            k = min(per, numel - done)
            at, want = load.offset + done * size_in, k * size_in
            slot = staging.slot(i)
            target = slot[:want] if scratch is None else scratch[:want]
            got = pread_exact(fd, _host_view(target), at)
            if got < want:
                raise IntegrityError(
                    f"{load.label}: checkpoint file {load.path} ended at offset {at + got}: the tensor needs "
                    f"{numel * size_in} bytes from offset {load.offset} (to offset {load.offset + numel * size_in}), "
                    f"the read at offset {at} got {got} of {want} bytes; the file was truncated: export again from "
                    "a complete checkpoint")
            drop_read(fd, at, want, last=done + k == numel)
            if scratch is not None:
                # copy_ casts as .to(dtype) does (convert.py's kernel): the bytes of the converted copy
                slot[: k * size_out].view(load.dtype).copy_(scratch[:want].view(stored))
            yield i, k * size_out
            done += k
            i += 1
        _check_identity(fd, load, "while it was read")
    finally:
        os.close(fd)


def _source_pieces(source: Source, staging: HostStaging) -> Iterator[tuple[int, int]]:
    i = 0
    step = staging.chunk_nbytes
    for piece in source.pieces(BufferRing(step, count=1)):
        view = memoryview(piece).cast("B")
        for start in range(0, len(view), step):
            n = min(step, len(view) - start)
            _host_view(staging.slot(i))[:n] = view[start : start + n]
            yield i, n
            i += 1


def load_to_device(load: DeviceLoad, staging: HostStaging) -> Any:
    """A new tensor on ``staging.device`` holding ``load``'s bytes (see the module
    docstring): ``load.dtype``, ``load.shape``, ``load.stride``, storage offset 0.

    Host memory: ``staging``'s buffers (reused) and, when converting, one piece
    of the stored dtype. Device memory: the tensor.

    Raises:
        IntegrityError: the file changed since ``load.identity`` (before or
            while it was read), a read came short (names file, key, offset),
            or a source gave another number of bytes than the tensor needs.
        OSError: the file cannot be opened or read.
    """
    import torch

    nbytes = _numel(load.shape) * _itemsize(load.dtype)
    dst = staging.empty(load.shape, load.stride, load.dtype)
    flat = torch.empty(0, dtype=torch.uint8, device=dst.device).set_(dst.untyped_storage(), 0, (nbytes,), (1,))
    if load.path is not None:
        pieces = _file_pieces(load, load.path, staging)
    elif load.source is not None:
        pieces = _source_pieces(load.source, staging)
    else:
        raise ValueError(f"{load.label}: a DeviceLoad needs a path or a source")
    staging.start()
    done = 0
    try:
        for i, n in pieces:
            if done + n > nbytes:
                raise IntegrityError(f"{load.label}: its source gave more than the {nbytes} bytes the tensor needs")
            staging.send(i, flat[done : done + n], n)
            done += n
    finally:
        staging.finish()
    if done != nbytes:
        raise IntegrityError(f"{load.label}: its source gave {done} bytes, the tensor needs {nbytes}")
    return dst


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

    ``checkpoint``: the context's :class:`~ptdstream.sources.checkpoint.Checkpoint`;
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
        self._copies: dict[tuple, Any] = {}  # (table, fqn, view, device) -> its device copy
        self._registered: list = []
        self.stats = DeviceLoadStats()

    def add(self, key: str, tensor: Any) -> None:
        """Record ``tensor`` (the one bound for checkpoint ``key``: its mapped view or converted copy)."""
        view = _view(tensor)
        if view is not None:
            self._bound[view] = (key, tensor)

    def staging_for(self, device: Any) -> HostStaging:
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
        if self.checkpoint.kind in ("safetensors", "torch"):
            source = self.checkpoint.source(key)
            view = self.checkpoint.tensor(key)
            identity = self.identities.get(entry.where)
            if (isinstance(source, MappedTensorSource) and source.read_file and identity is not None
                    and source.mapping.inode == identity.inode and _dense(view) and tuple(view.stride()) == stride):
                offset = source.mapping.offset + (view.data_ptr() - source.mapping.start)
                return DeviceLoad(label, shape, stride, bound.dtype, path=entry.where, offset=offset,
                                  stored=entry.dtype, identity=identity)
            if entry.dtype == bound.dtype and view is bound:
                return DeviceLoad(label, shape, stride, bound.dtype, source=source)  # the mapping, paged out
        storage = bound.untyped_storage()
        mapping = file_mapping(storage.data_ptr(), storage.nbytes())
        if mapping is None:
            return None
        return DeviceLoad(label, shape, stride, bound.dtype, source=MappedTensorSource(bound, mapping, label))

    def device_copy(self, table: str, fqn: str, tensor: Any, device: Any) -> Any:
        """The device copy of ``tensor`` (``table``'s ``fqn`` of a program being
        moved to ``device``), made now or by an earlier method; None when it is
        not one of this context's bound tensors, or is left to upstream."""
        view = _view(tensor)
        if view is None or view not in self._bound:
            return None
        cached = (table, fqn, view, str(device))
        if cached in self._copies:
            self.stats.reused += 1
            return self._copies[cached]
        key, bound = self._bound[view]
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
        self.stats.read_nbytes += copy.numel() * _itemsize(load.stored if load.stored is not None else load.dtype)
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
