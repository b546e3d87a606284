"""Quantization of storage-less weights: refused by name, before anything is written.

torchao's ``quantize_`` computes each quantized weight (scales, zero points,
integer data) from the weight's values. On a storage-less parameter
(:mod:`ptdstream.weightless.storage_less`) there are none: depending on the
config it fails deep inside torchao (HQQ: a data-dependent FakeTensor error;
``unwrap_tensor_subclass``: an ``AttributeError``) or, worse, builds a
quantized tensor subclass whose inner tensors are storage-less, which no
checkpoint tensor can fill.

So, inside :func:`~ptdstream.weightless.weights_from`:

* ``quantize_`` (the name in ``torchao``, ``torchao.quantization`` and
  ``torchao.quantization.quant_api``; optimum-executorch's ``qlinear`` and
  ``qembedding`` import it there when they run) is shadowed by
  :func:`refusing_quantize`: if a module it would quantize (``filter_fn``,
  torchao's default ``_is_linear``; any module for a ``FqnToConfig``) holds a
  storage-less parameter, it raises :class:`QuantizationNeedsValuesError`
  naming them, and the model is left unchanged;
* a quantized constant made from storage-less weights anyway (``quantize_``
  imported before the context opened) is refused by name by
  :meth:`~ptdstream.weightless.WeightsFrom.bind` and before emission
  (:func:`derived_from_storage_less`).

What to do: export with real weights (outside ``weights_from``); weights_from
binds plain checkpoint tensors only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..upstream import adapter
from ..upstream.patching import shadowed
from .errors import QuantizationNeedsValuesError
from .storage_less import is_storage_less

__all__ = ["QUANTIZE_MODULES", "derived_from_storage_less", "quantized_constants",
           "refusing_quantization"]

#: The modules whose global ``quantize_`` is shadowed (those that are importable).
QUANTIZE_MODULES = ("torchao", "torchao.quantization", "torchao.quantization.quant_api")


def derived_from_storage_less(tensor: Any) -> bool:
    """Whether ``tensor`` is a tensor subclass (a torchao quantized tensor) some
    inner tensor of which is storage-less, at any depth."""
    if not adapter.is_traceable_wrapper_subclass(tensor):
        return False
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, n) for n in names]
    return any(is_storage_less(t) or derived_from_storage_less(t) for t in inner)


def quantized_constants(programs: Mapping[str, Any]) -> list[str]:
    """``"method: 'fqn' (Type)"`` of every constant of ``programs`` made from storage-less weights, sorted."""
    found = set()
    for method, ep in programs.items():
        for table in ("state_dict", "constants"):
            for fqn, tensor in getattr(ep, table).items():
                if derived_from_storage_less(tensor):
                    found.add(f"{method}: {fqn!r} ({type(tensor).__name__})")
    return sorted(found)


def _describe(fqn: str, param: Any) -> str:
    return f"{fqn!r} ({param.dtype} {list(param.shape)})"


def _storage_less_targets(model: Any, config: Any, filter_fn: Any, default_filter: Any) -> list[str]:
    """The storage-less weights (``weight`` parameters; any parameter for a
    ``FqnToConfig``) of the modules ``quantize_(model, config, filter_fn)`` would visit."""
    import torch

    per_fqn = type(config).__name__ == "FqnToConfig"
    chosen = filter_fn or default_filter or (lambda module, fqn: isinstance(module, torch.nn.Linear))
    found: dict[int, str] = {}
    for prefix, module in model.named_modules():
        if not per_fqn and not chosen(module, prefix):
            continue
        for name, param in module.named_parameters(recurse=False):
            if (per_fqn or name == "weight") and is_storage_less(param) and id(param) not in found:
                found[id(param)] = _describe(f"{prefix}.{name}" if prefix else name, param)
    return sorted(found.values())


def refusing_quantize(real: Callable[..., Any], default_filter: Any) -> Callable[..., Any]:
    """``quantize_`` that refuses storage-less weights first (see the module docstring)."""
    missing = object()

    @functools.wraps(real)
    def quantize_(model, config, filter_fn=missing, *args, **kwargs):
        chosen = default_filter if filter_fn is missing else filter_fn
        names = _storage_less_targets(model, config, chosen, default_filter)
        if names:
            raise QuantizationNeedsValuesError(names, f"torchao quantize_ ({type(config).__name__})")
        if filter_fn is missing:
            return real(model, config, *args, **kwargs)
        return real(model, config, filter_fn, *args, **kwargs)

    return quantize_


@contextlib.contextmanager
def refusing_quantization() -> Iterator[None]:
    """While active, torchao's ``quantize_`` refuses storage-less weights by name
    (every thread: it refuses only what cannot be computed). Does nothing when
    torchao is not importable."""
    try:
        api = importlib.import_module("torchao.quantization.quant_api")
    except ImportError:
        yield
        return
    real, default_filter = api.quantize_, getattr(api, "_is_linear", None)
    wrapper = refusing_quantize(real, default_filter)
    with contextlib.ExitStack() as patches:
        for name in QUANTIZE_MODULES:
            module = importlib.import_module(name)
            if getattr(module, "quantize_", None) is real:
                patches.enter_context(shadowed(module, "quantize_", wrapper))
        yield
