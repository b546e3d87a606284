"""HQQ scale-only quantization of a large weight in bands of rows, with the whole tensor's bytes.

torchao's HQQ scale-only (``quant_primitives.py``,
``_choose_qparams_and_quantize_scale_only_hqq``: optimum's default algorithm)
refines each group's scale by least squares for up to ``iters`` iterations and
stops after the first iteration whose largest relative change of a scale, over
the whole tensor, is below ``early_stop_tol``. Each group's scales at a given
iteration depend on that group alone; only the stop is the whole tensor's. So
the whole tensor's iterations can be run band by band, iteration by iteration
(:class:`Search`), keeping only the scales between iterations:

1. :func:`probed`: the first band goes through torchao's handler as it would,
   up to its call of the HQQ function, which gives its arguments (the block
   size and the integer range) and the function called, and ends the call;
2. :meth:`Search.run`: the initial scales of every band, then each iteration
   over every band (the same operations as torchao's loop, on the band), the
   whole tensor's change being the largest of the bands' (NaN if one is NaN,
   as ``torch.max`` over the tensor), until the first iteration whose change
   compares below the tolerance as torchao compares it, else ``iters``
   (:attr:`Search.stop`); the band's values are read again at each iteration
   (or held, when the caller holds them);
3. :func:`answered`: each band through torchao's handler, its HQQ call
   answered with the band's levels at the scales found (torchao's last step),
   the first band's answer compared byte for byte with torchao's own function
   run for :attr:`Search.stop` iterations (once per process for each integer
   range, group size, dtype, stop and function called). Where they differ (a
   torchao whose loop is not this one), the caller runs the bands under
   :func:`fixed_iterations`: torchao's own function on each band, exactly that
   many iterations, no early stop.

All act only in the thread that asked (torchao's function stays its own
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

__all__ = ["Search", "answered", "fixed_iterations", "probed", "routing_hqq"]

_local = threading.local()  # .mode: None, ("probe", None), ("given", Search) or ("fixed", iterations)
_lock = threading.Lock()
#: (qmin, qmax, group size, dtype, iterations, function) -> whether the levels at the scales found were torchao's own,
#: checked once per process and kind of weight (the same operations: the answer is the code's, not a weight's)
_checked: dict[tuple[Any, ...], bool] = {}


class _Probed(Exception):
    """torchao's handler reached its HQQ function: its block size and integer range,
    and the function it called (``real``: torchao's, or what the user set in its place)."""

    def __init__(self, block_size: Any, qmin: int, qmax: int, real: Callable[..., Any] | None = None) -> None:
        super().__init__(block_size, qmin, qmax)
        self.block_size, self.qmin, self.qmax = block_size, qmin, qmax
        self.real = real if real is not None else adapter.hqq_scale_only_function()


class _NotTorchaos(Exception):
    """The first band's levels at the scales found are not torchao's own: run :func:`fixed_iterations`."""


def _eps() -> float:
    import torch

    return torch.finfo(torch.float32).eps


def _grouped(hp: Any, group: int) -> Any:
    """``hp`` (2-D) as torchao's loop sees it: float32, ``[rows, groups, group]``."""
    import torch

    rows, cols = hp.shape
    return hp.detach().to(torch.float32).contiguous().view(rows, cols // group, group)


def _initial_scale(values: Any, qmin: int, qmax: int) -> Any:
    largest_level = max(abs(qmin), abs(qmax)) or 1
    return (values.abs().amax(dim=2) / largest_level).clamp_min(_eps())


def _iteration(values: Any, previous: Any, qmin: int, qmax: int) -> tuple[Any, Any]:
    """One least-squares update of the scales ``previous`` of ``values``: the new
    scales and the largest relative change (float32 0-dim)."""
    import torch

    eps = _eps()
    levels = (values / previous.unsqueeze(-1)).round().clamp(qmin, qmax)
    fit = (values * levels).sum(dim=2, dtype=torch.float32)
    norm = (levels * levels).sum(dim=2, dtype=torch.float32)
    scale = torch.where(norm > 0, fit / norm, previous).clamp_min(eps).abs()
    return scale, ((scale - previous).abs() / previous.clamp_min(eps)).max()


def _levels(values: Any, scale: Any, qmin: int, qmax: int) -> Any:
    return (values / scale.unsqueeze(-1)).round().clamp(qmin, qmax)


class Search:
    """The whole tensor's HQQ scale-only iterations over its bands (step 2 of the
    module docstring): torchao's ``iters`` and ``early_stop_tol`` defaults (its
    signature's), the probe's arguments, each band's scales (float32 ``[rows,
    groups]``) and the iteration the whole tensor stops at."""

    def __init__(self, probe: _Probed) -> None:
        """Raises:
            _NotTorchaos: the function called has no ``iters`` and ``early_stop_tol`` defaults to run by.
        """
        try:  # the function called: its defaults
            parameters = inspect.signature(probe.real).parameters
            self.iters = max(1, int(parameters["iters"].default))
            self.tol = float(parameters["early_stop_tol"].default)
        except (KeyError, TypeError, ValueError):
            raise _NotTorchaos from None
        self.group = int(probe.block_size[1])
        self.qmin, self.qmax = probe.qmin, probe.qmax
        self.real = probe.real
        self.scales: list[Any] = []
        self.stop = 0  #: the iteration (1-based) after which the whole tensor's loop stops; 0 before run
        self._answered = 0

    def run(self, band: Callable[[int], Any], planned: list[tuple[int, int]]) -> None:
        """Find every band's scales at the whole tensor's stop: ``planned`` are the
        bands' rows ``[r0, r1)`` and ``band(i)`` gives band ``i``'s values (2-D, in the
        weight's dtype), once for the initial scales and once per iteration. The
        scales and changes live in two tensors made once (a band's temporaries,
        freed at each iteration, are reused from the heap rather than scattered
        among longer-lived scales)."""
        import torch

        with torch.no_grad():  # a Parameter's band: no graph
            scales: Any = None
            changes = torch.empty(len(planned), dtype=torch.float32)
            for i, (r0, r1) in enumerate(planned):
                first = _initial_scale(_grouped(band(i), self.group), self.qmin, self.qmax)
                if scales is None:
                    scales = torch.empty((planned[-1][1], first.shape[1]), dtype=torch.float32)
                scales[r0:r1] = first
                del first
            self.scales = [scales[r0:r1] for r0, r1 in planned]
            for iteration in range(1, self.iters + 1):
                for i, previous in enumerate(self.scales):
                    scale, changes[i] = _iteration(_grouped(band(i), self.group), previous, self.qmin, self.qmax)
                    previous.copy_(scale)
                    del scale
                self.stop = iteration
                if bool(changes.max() < self.tol):  # as torchao compares its float32 change
                    break

    def answer(self, hp: Any, block_size: Any, qmin: int, qmax: int, real: Callable[..., Any]) -> tuple[Any, Any]:
        """torchao's ``(qdata, scale)`` for the next band: its levels at the scales found
        (int32, ``hp``'s shape) and those scales in ``hp``'s dtype.

        Raises:
            _NotTorchaos: the first band's answer is not torchao's own function's for
                :attr:`stop` iterations; or the band is not the one expected.
        """
        import torch

        index = self._answered
        if (index >= len(self.scales) or (qmin, qmax, int(block_size[1])) != (self.qmin, self.qmax, self.group)
                or tuple(self.scales[index].shape) != (hp.shape[0], hp.shape[1] // self.group)):
            raise _NotTorchaos
        self._answered += 1
        with torch.no_grad():
            scale = self.scales[index]
            qdata = _levels(_grouped(hp, self.group), scale, qmin, qmax).view(hp.shape).to(torch.int32)
            scale = scale.to(hp.dtype)
        if index == 0:
            key = (qmin, qmax, self.group, hp.dtype, self.stop, real)  # a function set in torchao's place: checked anew
            with _lock:
                same = _checked.get(key)
            if same is None:
                own_qdata, own_scale = real(hp, block_size, qmin, qmax, iters=self.stop,
                                            early_stop_tol=float("-inf"))
                same = _same_bytes(qdata, own_qdata) and _same_bytes(scale, own_scale)
                with _lock:
                    _checked[key] = same
            if not same:
                raise _NotTorchaos
        return qdata, scale


def _same_bytes(a: Any, b: Any) -> bool:
    """Whether two tensors have the same dtype, shape and bytes (NaNs compared by their bits)."""
    import torch

    if (a.dtype, a.shape) != (b.dtype, b.shape):
        return False
    flat_a, flat_b = a.detach().contiguous().view(-1), b.detach().contiguous().view(-1)
    if flat_a.element_size() > 1:
        flat_a, flat_b = flat_a.view(torch.uint8), flat_b.view(torch.uint8)
    return torch.equal(flat_a, flat_b)


def _routed(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def _choose_qparams_and_quantize_scale_only_hqq(hp_tensor, block_size, qmin, qmax, **kwargs):
        mode = getattr(_local, "mode", None)
        if mode is None or kwargs:
            return real(hp_tensor, block_size, qmin, qmax, **kwargs)
        kind, value = mode
        if kind == "fixed":
            return real(hp_tensor, block_size, qmin, qmax, iters=value, early_stop_tol=float("-inf"))
        if kind == "probe":
            raise _Probed(block_size, qmin, qmax, real)
        return value.answer(hp_tensor, block_size, qmin, qmax, real)

    return _choose_qparams_and_quantize_scale_only_hqq


@contextlib.contextmanager
def routing_hqq() -> Iterator[None]:
    """While active, :func:`probed`, :func:`answered` and :func:`fixed_iterations`
    can act (in their own thread); elsewhere torchao's function runs as it is."""
    module = adapter.intx_unpacked_module()
    name = "_choose_qparams_and_quantize_scale_only_hqq"
    with shadowed(module, name, _routed(getattr(module, name))):
        yield


@contextlib.contextmanager
def _mode(mode: tuple[str, Any]) -> Iterator[None]:
    _local.mode = mode
    try:
        yield
    finally:
        _local.mode = None


def probed(call: Callable[[], Any]) -> Search | None:
    """``call()`` (torchao's handler on a first band) with its HQQ call answered by a
    probe (step 1 of the module docstring): a :class:`Search` for the arguments it
    was called with; None where the handler called no HQQ function, or the function
    called has no ``iters`` and ``early_stop_tol`` defaults to run by."""
    try:
        with _mode(("probe", None)):
            call()
    except _Probed as probe:
        try:
            return Search(probe)
        except _NotTorchaos:
            return None
    return None


def answered(search: Search, call: Callable[[], Any]) -> tuple[bool, Any]:
    """``call()`` with torchao's HQQ scale-only calls answered band after band from
    ``search`` (step 3 of the module docstring): ``(True, its result)``, or ``(False,
    None)`` where the first band's answer is not torchao's own (run the bands under
    :func:`fixed_iterations` instead)."""
    try:
        with _mode(("given", search)):
            return True, call()
    except _NotTorchaos:
        return False, None


def fixed_iterations(iterations: int) -> contextlib.AbstractContextManager[None]:
    """In this thread, torchao's HQQ scale-only runs exactly ``iterations``
    iterations, no early stop."""
    return _mode(("fixed", iterations))
