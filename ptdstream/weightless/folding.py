"""``constant_prop_pass`` on bound programs, one folded constant in memory at a time.

executorch 1.5.1's ``constant_prop_pass`` (``exir/passes/constant_prop_pass.py``;
run by ``to_executorch`` with ``ExecutorchBackendConfig(do_quant_fusion_and_const_prop=True)``,
as executorch's LLM export and optimum-executorch's XNNPACK recipe do) computes
every foldable node (a linear weight's transpose becomes a
``_prop_tensor_constantN``) and keeps each result, intermediates included, in
the dict ``get_propagated_const_tensor_dict`` fills: on a program bound to a
checkpoint that is a second copy of every folded weight, all in memory at once.

While :func:`folded_to_files` is active in the calling thread or task, that
dict (the one ``get_constant_placeholder_dict`` returns: its module global is
shadowed) moves each folded tensor computed from a bound weight (or from one
folded so before) out of memory as soon as it is stored:
:func:`~ptdstream.weightless.mapped_copy.mapped_copy` writes it to a nameless
temp file and maps it back, and the pages of the bound inputs it read are
paged out. The pass then holds about one folded tensor and its inputs at a
time; the values, names and order of the constants are upstream's, so the
saved bytes are the same. A folded tensor computed from real tensors only
(buffers such as rotary ``inv_freq``), or a view of its input, stays as
upstream makes it. The mapped copies are registered as bound
(:func:`~ptdstream.weightless.delegates.add_bound`): the emitter and the save
stream them, XNNPACK's per-partition copy shares them.

A transpose of a bound 2-D weight larger than :data:`BAND_NBYTES` (a
linear's ``permute_copy``, ``t_copy`` or ``transpose_copy``) is not computed in
memory at all: while the pass computes its constants
(``get_propagated_const_tensor_dict``, shadowed to run under a dispatch mode),
that call is answered by :func:`~ptdstream.weightless.mapped_copy.mapped_transpose`,
which writes the transpose to a nameless temp file in bands of
:data:`BAND_NBYTES` (the weight's pages handed back piece by piece), the same
bytes. Any other call runs as upstream's.

Disk: the folded bytes (about the size of the folded weights) in ``folder``,
or a fresh folder under ``tempfile.gettempdir()`` (``TMPDIR``), removed on exit.
After each folded tensor moved to a file, the C heap is handed back
(:func:`~ptdstream.weightless.lowering.trim_heap`): the one computed before it,
freed by then, would otherwise stay resident (glibc keeps blocks of a few MiB).
No upstream code is copied; the name is registered in
:mod:`ptdstream.upstream.names`, the patch scoped (:mod:`ptdstream.upstream.patching`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from ..system.pagecache import file_mapping, page_out
from ..upstream import adapter
from ..upstream.patching import shadowed
from .delegates import add_bound, is_bound
from .lowering import trim_heap
from .mapped_copy import mapped_copy, mapped_transpose

__all__ = ["BAND_NBYTES", "FoldingDict", "folded_to_files"]

#: bytes of a transposed band (and of a piece of the weight read for it); larger transposes go to files in bands
BAND_NBYTES = 16 << 20


class _Target:
    """Where the folded tensors of one :func:`folded_to_files` context go."""

    def __init__(self, folder: str | None, bound: list[Any]) -> None:
        self.given = folder
        self.folder: str | None = folder
        self.bound = bound
        self.moved = 0  # bytes moved to files
        self.open = True  # False once its context exited (in any thread)
        self._lock = threading.Lock()

    def path(self) -> str:
        with self._lock:
            if self.folder is None:
                self.folder = tempfile.mkdtemp(prefix="ptdstream-folded-")
            return self.folder


_targets: contextvars.ContextVar[tuple[_Target, ...]] = contextvars.ContextVar("ptdstream_folded_to_files",
                                                                                default=())


def _page_out(tensor: Any) -> None:
    nbytes = tensor.untyped_storage().nbytes()
    address = tensor.untyped_storage().data_ptr()
    mapping = file_mapping(address, nbytes) if nbytes else None
    if mapping is not None:
        page_out(address, nbytes, (mapping.start, mapping.stop))


class FoldingDict(OrderedDict):
    """``constant_prop_pass``'s node -> tensor dict that moves each folded
    tensor of a bound input to a file (see the module docstring)."""

    def __init__(self, items: Any, target: _Target) -> None:
        self._target = target
        super().__init__(items)

    def __setitem__(self, node: Any, value: Any) -> None:
        import torch

        if getattr(node, "op", None) == "call_function" and isinstance(value, torch.Tensor) and not is_bound(value):
            inputs = [self[n] for n in node.all_input_nodes if n in self]
            if (self._target.open and value.device.type == "cpu" and not isinstance(value, adapter.fake_tensor_type())
                    and not value.is_meta and value.untyped_storage().nbytes()
                    and any(is_bound(t) for t in inputs)
                    and all(value.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
                            for t in inputs)):
                moved = mapped_copy(value, self._target.path())
                self._target.moved += moved.untyped_storage().nbytes()
                del value
                trim_heap()  # the folded tensor before this one, computed in memory and freed by now
                add_bound(self._target.bound, [moved])
                for t in inputs:
                    if is_bound(t):
                        _page_out(t)
                value = moved
        super().__setitem__(node, value)


def _folding(real: Callable[..., Any]) -> Callable[..., Any]:
    """``get_constant_placeholder_dict`` returning a :class:`FoldingDict` in a context."""

    @functools.wraps(real)
    def get_constant_placeholder_dict(exported_program):
        found = real(exported_program)
        targets = _targets.get()
        return FoldingDict(found, targets[-1]) if targets else found

    return get_constant_placeholder_dict


def _transposed_input(func: Any, args: tuple, kwargs: dict) -> Any:
    """The 2-D tensor ``func(*args, **kwargs)`` transposes, or None."""
    import torch

    aten = torch.ops.aten
    if kwargs or not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 2:
        return None
    if func is aten.t_copy.default and len(args) == 1:
        return args[0]
    if func is aten.permute_copy.default and len(args) == 2 and [d % 2 for d in args[1]] == [1, 0]:
        return args[0]
    if func is aten.transpose_copy.int and len(args) == 3 and {args[1] % 2, args[2] % 2} == {0, 1}:
        return args[0]
    return None


def _transposing_mode(target: _Target) -> Any:
    class TransposingToFiles(adapter.dispatch_mode_type()):  # type: ignore[misc]  # torch's mode class, resolved by the adapter
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensor = _transposed_input(func, args, kwargs)
            if (tensor is not None and target.open and is_bound(tensor) and tensor.device.type == "cpu"
                    and not isinstance(tensor, adapter.fake_tensor_type()) and tensor.is_contiguous()
                    and tensor.numel() * tensor.element_size() > BAND_NBYTES):
                moved = mapped_transpose(tensor, target.path(), BAND_NBYTES)
                target.moved += moved.untyped_storage().nbytes()
                add_bound(target.bound, [moved])
                return moved
            return func(*args, **kwargs)

    return TransposingToFiles()


def _transposing(real: Callable[..., Any]) -> Callable[..., Any]:
    """``get_propagated_const_tensor_dict`` run under :func:`_transposing_mode` in a context."""

    @functools.wraps(real)
    def get_propagated_const_tensor_dict(*args, **kwargs):
        targets = _targets.get()
        if not targets:
            return real(*args, **kwargs)
        with _transposing_mode(targets[-1]):
            return real(*args, **kwargs)

    return get_propagated_const_tensor_dict


@contextlib.contextmanager
def folded_to_files(bound: list[Any], folder: str | None = None) -> Iterator[_Target]:
    """While active, in the calling thread or task, ``constant_prop_pass`` moves
    each tensor it folds from a bound weight to a file in ``folder`` (None: a
    fresh temp folder, removed on exit) and appends it to ``bound`` (a
    :func:`~ptdstream.weightless.delegates.bound_weights` list). Nests (the
    innermost context's folder is used). Does nothing when executorch's pass is
    not importable.

    Raises:
        OSError: a temp file cannot be created or written (the folder named),
            from within the pass.
    """
    target = _Target(folder, bound)
    token = _targets.set(_targets.get() + (target,))
    try:
        with contextlib.ExitStack() as patches:
            try:
                module = adapter.constant_prop_module()
            except ImportError:
                module = None
            if module is not None:
                patches.enter_context(shadowed(module, "get_constant_placeholder_dict",
                                               _folding(module.get_constant_placeholder_dict)))
                patches.enter_context(shadowed(module, "get_propagated_const_tensor_dict",
                                               _transposing(module.get_propagated_const_tensor_dict)))
            yield target
    finally:
        target.open = False
        try:
            _targets.reset(token)
        except ValueError:
            pass  # exited in another context: the target is dropped with it
        with target._lock:
            if target.given is None and target.folder is not None:
                shutil.rmtree(target.folder, ignore_errors=True)  # nameless files: the folder is empty
                target.folder = None
