"""Models whose parameters hold no storage: FakeTensors on the CPU.

A storage-less tensor has a dtype, shape, strides and device (``cpu``) and no
bytes: ``torch.export`` traces it as it traces a real one, and nothing of its
size is ever allocated. Such models are built three ways:

* :func:`storage_less_model` with a module factory: the factory runs with
  ``torch.nn.Module.register_parameter`` patched (scoped, through
  :mod:`ptdstream.upstream.patching`, like accelerate's ``init_empty_weights``)
  so that each parameter is replaced, as it is registered, by a storage-less
  one of its dtype and shape. Buffers stay real (non-persistent ones, such as
  rotary ``inv_freq``, are computed by the factory as usual).
* :func:`storage_less_model` with a module built under ``torch.device("meta")``:
  its meta parameters and meta persistent buffers become storage-less cpu
  tensors (in place). A meta non-persistent buffer has no value anywhere and
  is refused by name.
* a module whose parameters already are FakeTensors: taken as it is.

Memory: the factory's own ``torch.empty`` calls allocate (untouched) memory
for one parameter at a time, freed when it is replaced; the built model holds
no parameter bytes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..upstream import adapter
from ..upstream.patching import shadowed
from .errors import MetaBufferError

__all__ = ["derived_from_storage_less", "inner_tensors", "is_storage_less", "meta_to_storage_less", "storage_less",
           "storage_less_model"]

_local = threading.local()  # the fake mode of the thread building a model


def is_storage_less(tensor: Any) -> bool:
    """Whether ``tensor`` holds no bytes: a FakeTensor or a meta tensor."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        return False
    return isinstance(tensor, adapter.fake_tensor_type()) or tensor.is_meta


def derived_from_storage_less(tensor: Any) -> bool:
    """Whether ``tensor`` is a tensor subclass (a torchao quantized tensor) some
    inner tensor of which is storage-less, at any depth."""
    if not adapter.is_traceable_wrapper_subclass(tensor):
        return False
    return any(is_storage_less(t) or derived_from_storage_less(t) for t in inner_tensors(tensor))


def inner_tensors(tensor: Any) -> list[Any]:
    """The inner tensors of tensor subclass ``tensor`` (a torchao quantized tensor:
    ``qdata``, ``scale``, ``zero_point``), in ``__tensor_flatten__``'s order."""
    names, _ = tensor.__tensor_flatten__()
    return [getattr(tensor, n) for n in names]


def _mode() -> Any:
    mode = getattr(_local, "mode", None)
    if mode is None:
        mode = _local.mode = adapter.fake_tensor_mode(allow_non_fake_inputs=True)
    return mode


def storage_less(tensor: Any) -> Any:
    """A storage-less cpu tensor of ``tensor``'s dtype, shape and strides (a
    ``torch.nn.Parameter`` with its ``requires_grad`` if ``tensor`` is one)."""
    import torch

    with _mode():
        fake = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="cpu")
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
    return fake


def meta_to_storage_less(model: Any) -> None:
    """``model``'s meta parameters and meta persistent buffers -> storage-less cpu
    tensors, in place; tied parameters stay tied (one storage-less tensor per
    original object); nothing else changes (a module without meta tensors is left as it is).

    Raises:
        MetaBufferError: a non-persistent buffer on the meta device, by name.
    """
    done: dict[int, Any] = {}
    bad = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in done:
                    done[id(param)] = storage_less(param)
                module._parameters[name] = done[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is None or not buf.is_meta:
                continue
            if name in module._non_persistent_buffers_set:
                bad.append(f"{prefix}.{name}" if prefix else name)
                continue
            if id(buf) not in done:
                done[id(buf)] = storage_less(buf)
            module._buffers[name] = done[id(buf)]
    if bad:
        raise MetaBufferError(
            f"{len(bad)} non-persistent buffer(s) on the meta device, with no value in any checkpoint: "
            f"{', '.join(repr(b) for b in sorted(set(bad)))}; build the model from a factory "
            "(storage_less_model(factory)) so that they are computed, or assign real tensors")


@contextlib.contextmanager
def _storage_less_parameters() -> Iterator[None]:
    """While active, in the calling thread, a parameter registered on any module
    is replaced by a storage-less one (other threads register as usual)."""
    import torch

    original = torch.nn.Module.register_parameter

    def register_parameter(self, name, param):
        original(self, name, param)
        if getattr(_local, "building", 0) and param is not None and not is_storage_less(param):
            self._parameters[name] = storage_less(param)

    _local.building = getattr(_local, "building", 0) + 1
    try:
        with shadowed(torch.nn.Module, "register_parameter", register_parameter):
            yield
    finally:
        _local.building -= 1


def storage_less_model(factory_or_module: Callable[[], Any] | Any) -> Any:
    """A model whose parameters (and meta persistent buffers) are storage-less cpu tensors.

    ``factory_or_module``: a callable returning a ``torch.nn.Module`` (run with
    storage-less parameters; real buffers), or a module (its meta tensors
    converted in place, see the module docstring). Returns the module, in eval mode.

    Example::

        model = storage_less_model(lambda: MyModel(config))

    Raises:
        MetaBufferError: a non-persistent buffer on the meta device, by name.
        TypeError: the factory returned something that is not a module.
    """
    import torch

    if isinstance(factory_or_module, torch.nn.Module):
        model = factory_or_module
    else:
        with _storage_less_parameters():
            model = factory_or_module()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"the model factory returned a {type(model).__name__}, not a torch.nn.Module")
    meta_to_storage_less(model)
    return model.eval()
