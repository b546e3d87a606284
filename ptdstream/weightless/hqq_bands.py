"""HQQ scale-only quantization of a large weight in bands of rows, with the whole tensor's bytes.

torchao's HQQ scale-only (``quant_primitives.py``,
``_choose_qparams_and_quantize_scale_only_hqq``: optimum's default algorithm)
refines each group's scale by least squares for up to ``iters`` iterations and
stops after the first iteration whose largest relative change of a scale, over
the whole tensor, is below ``early_stop_tol``. Each group's scales at a given
iteration depend on that group alone; only the stop is the whole tensor's. So
the whole tensor's result is each band's result after exactly the iteration
the whole tensor stops at, found by a first pass:

1. :func:`recording_changes`: each band goes through torchao's handler as it
   would (its arguments: the band, the block size, the integer range), but the
   iterations are run here, all ``iters`` of them, recording each iteration's
   largest relative change in the band (a float32 value; NaN when a group's
   change is NaN, as torch's ``max`` gives it). The whole tensor's change at an
   iteration is the largest of the bands' (NaN if one is NaN), and its stop
   :meth:`Changes.stop` the first iteration whose change compares below the
   tolerance as torchao compares it, else ``iters``;
2. :func:`fixed_iterations`: each band quantized by torchao's own function
   with ``iters`` that iteration and no early stop: its bytes.

The first pass's own quantized values are those of all ``iters`` iterations,
computed as torchao computes them (the same operations on the same band);
the first band's are compared byte for byte with torchao's own function run
for ``iters`` iterations (:attr:`Changes.checked`; once per process for each
integer range, group size, dtype and ``iters``). Where the whole tensor runs
every iteration (no early stop: random weights, and in practice most large
ones) and that check held, the first pass's bands are the tensor's bytes and
the second pass is skipped (:meth:`Changes.complete`).

Both act only in the thread that asked (torchao's function stays its own
elsewhere), through one module global: ``_choose_qparams_and_quantize_scale_only_hqq``
as ``intx_unpacked_to_int8_tensor.py`` looks it up
(:func:`~ptdstream.upstream.adapter.intx_unpacked_module`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..upstream import adapter
from ..upstream.patching import shadowed

__all__ = ["Changes", "fixed_iterations", "recording_changes", "routing_hqq"]

_local = threading.local()  # .mode: None, ("record", Changes) or ("fixed", iterations)
_lock = threading.Lock()
#: (qmin, qmax, group size, dtype, iters) -> whether the first pass's values were torchao's own, checked
#: once per process and kind of weight (the same operations: the answer is the code's, not a weight's)
_checked: dict[tuple[Any, ...], bool] = {}


class Changes:
    """Each iteration's largest relative scale change over the bands seen so far
    (float32 0-dim tensors; ``None`` before the first band), and torchao's
    ``iters`` and ``early_stop_tol`` defaults (its signature's)."""

    def __init__(self, iters: int, tol: float) -> None:
        self.iters = max(1, iters)
        self.tol = tol
        self.largest: list[Any] | None = None
        self.bands = 0  #: bands recorded
        #: whether the first band's values (all ``iters`` iterations, computed here) were torchao's
        #: own, byte for byte (None before the first band)
        self.checked: bool | None = None

    def add(self, band: list[Any]) -> None:
        """Merge one band's changes (one per iteration): NaN wins, as ``torch.max`` over the tensor."""
        import torch

        self.bands += 1
        if self.largest is None:
            self.largest = list(band)
        else:
            self.largest = [torch.stack([a, b]).max() for a, b in zip(self.largest, band, strict=True)]

    def stop(self) -> int:
        """The iteration (1-based) after which the whole tensor's loop stops."""
        for i, change in enumerate(self.largest or []):
            if bool(change < self.tol):  # a float32 tensor against a Python float, as torchao compares
                return i + 1
        return self.iters

    def complete(self) -> bool:
        """Whether the values recorded with the changes are the whole tensor's: it runs
        every iteration, and the first band's values were torchao's own."""
        return self.checked is True and self.stop() == self.iters


def _same_bytes(a: Any, b: Any) -> bool:
    """Whether two tensors have the same dtype, shape and bytes (NaNs compared by their bits)."""
    import torch

    if (a.dtype, a.shape) != (b.dtype, b.shape):
        return False
    flat_a, flat_b = a.detach().contiguous().view(-1), b.detach().contiguous().view(-1)
    if flat_a.element_size() > 1:
        flat_a, flat_b = flat_a.view(torch.uint8), flat_b.view(torch.uint8)
    return torch.equal(flat_a, flat_b)


def _changes_of(hp: Any, block_size: Any, qmin: int, qmax: int, iters: int) -> tuple[list[Any], Any, Any]:
    """All ``iters`` iterations of the scale-only update on ``hp`` (2-D, groups of
    ``block_size[1]`` along its rows), no early stop: each iteration's largest
    relative change (float32 0-dim), and the last quantized values (int32, the
    shape of ``hp``) and scales (``hp``'s dtype), for torchao's caller to wrap."""
    import torch

    with torch.no_grad():  # a Parameter's band: no graph (each change would keep every iteration's tensors)
        return _changes_without_grad(hp.detach(), block_size, qmin, qmax, iters)


def _changes_without_grad(hp: Any, block_size: Any, qmin: int, qmax: int, iters: int) -> tuple[list[Any], Any, Any]:
    import torch

    eps = torch.finfo(torch.float32).eps
    rows, cols = hp.shape
    group = int(block_size[1])
    values = hp.to(torch.float32).contiguous().view(rows, cols // group, group)
    largest_level = max(abs(qmin), abs(qmax)) or 1
    previous = (values.abs().amax(dim=2) / largest_level).clamp_min(eps)
    changes = []
    for _ in range(iters):
        levels = (values / previous.unsqueeze(-1)).round().clamp(qmin, qmax)
        fit = (values * levels).sum(dim=2, dtype=torch.float32)
        norm = (levels * levels).sum(dim=2, dtype=torch.float32)
        scale = torch.where(norm > 0, fit / norm, previous).clamp_min(eps).abs()
        changes.append(((scale - previous).abs() / previous.clamp_min(eps)).max())
        previous = scale
    levels = (values / previous.unsqueeze(-1)).round().clamp(qmin, qmax)
    return changes, levels.view(rows, cols).to(torch.int32), previous.to(hp.dtype)


def _routed(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def _choose_qparams_and_quantize_scale_only_hqq(hp_tensor, block_size, qmin, qmax, **kwargs):
        mode = getattr(_local, "mode", None)
        if mode is None or kwargs:
            return real(hp_tensor, block_size, qmin, qmax, **kwargs)
        kind, value = mode
        if kind == "fixed":
            return real(hp_tensor, block_size, qmin, qmax, iters=value, early_stop_tol=float("-inf"))
        band, qdata, scale = _changes_of(hp_tensor, block_size, qmin, qmax, value.iters)
        if value.checked is None:  # the first band: the values computed here against torchao's own
            key = (qmin, qmax, int(block_size[1]), hp_tensor.dtype, value.iters)
            with _lock:
                value.checked = _checked.get(key)
            if value.checked is None:
                own_qdata, own_scale = real(hp_tensor, block_size, qmin, qmax, iters=value.iters,
                                            early_stop_tol=float("-inf"))
                value.checked = _same_bytes(qdata, own_qdata) and _same_bytes(scale, own_scale)
                with _lock:
                    _checked[key] = value.checked
        value.add(band)
        return qdata, scale

    return _choose_qparams_and_quantize_scale_only_hqq


@contextlib.contextmanager
def routing_hqq() -> Iterator[None]:
    """While active, :func:`recording_changes` and :func:`fixed_iterations` can act
    (in their own thread); elsewhere torchao's function runs as it is."""
    module = adapter.intx_unpacked_module()
    name = "_choose_qparams_and_quantize_scale_only_hqq"
    with shadowed(module, name, _routed(getattr(module, name))):
        yield


def _defaults() -> tuple[int, float]:
    real = adapter.hqq_scale_only_function()
    parameters = inspect.signature(real).parameters
    return int(parameters["iters"].default), float(parameters["early_stop_tol"].default)


@contextlib.contextmanager
def recording_changes() -> Iterator[Changes]:
    """In this thread, torchao's HQQ scale-only calls record their changes into
    the :class:`Changes` yielded (step 1 of the module docstring); the quantized
    tensors they return are those of all ``iters`` iterations: the tensor's only
    where :meth:`Changes.complete` (else discard them)."""
    changes = Changes(*_defaults())
    _local.mode = ("record", changes)
    try:
        yield changes
    finally:
        _local.mode = None


@contextlib.contextmanager
def fixed_iterations(iterations: int) -> Iterator[None]:
    """In this thread, torchao's HQQ scale-only runs exactly ``iterations``
    iterations, no early stop (step 2 of the module docstring)."""
    _local.mode = ("fixed", iterations)
    try:
        yield
    finally:
        _local.mode = None
