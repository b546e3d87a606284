"""A large weight quantized band by band by torchao's handler, with the bytes of the whole tensor.

:func:`quantize_in_bands` sets each band of rows (:func:`bands`) as the module's
weight, runs torchao's handler of the config on it, appends the band's inner
tensors (``qdata``, ``scale``, ``zero_point``: one row per row of the weight) to
nameless files (:class:`~ptdstream.weightless.mapped_copy.RowFiles`) and frees
the band before reading the next one; the result is the tensor type torchao
made, over those files. Under ``hqq_scale_only`` the whole tensor's
iterations are first run over the bands, iteration by iteration, to the one
it stops at; each band's levels at those scales are then its bytes
(:mod:`ptdstream.weightless.hqq_bands`; a weight of at most
:data:`HELD_NBYTES` is held while its iterations run, a larger one read again
at each). Anything else than one row of
inner tensors per row, or a NaN in a band under the ``affine`` algorithm (torch's
min/max give a NaN scale other bits in a band), gives None (the caller quantizes
the tensor whole).
"""

from __future__ import annotations

from typing import Any

from ..upstream import adapter
from .hqq_bands import Search, answered, fixed_iterations, probed
from .mapped_copy import RowFiles

__all__ = ["HELD_NBYTES", "bands", "hqq_search", "quantize_in_bands", "restore_extra_repr"]

#: an HQQ weight of at most this many bytes (its bands' values in float32) is held while its
#: iterations run; a larger one is read again from its source at each iteration
HELD_NBYTES = 32 << 20


class _NotRowWise(Exception):
    """torchao's bands did not come out one row of inner tensors per row: quantize the tensor whole."""


class _NaNUnderAffine(_NotRowWise):
    """A band holds a NaN under the ``affine`` algorithm: quantize the tensor whole. torch's
    min/max reductions give a NaN scale other sign and payload bits in a band than in the
    whole tensor (their loop over the rows depends on the row count), so only the whole
    tensor gives upstream's bytes."""


def restore_extra_repr(module: Any, extra_repr: Any) -> None:
    """``module``'s ``extra_repr`` as it was before torchao's handler wrapped it."""
    if extra_repr is None:
        module.__dict__.pop("extra_repr", None)
    else:
        module.extra_repr = extra_repr


def bands(rows: int, step: int) -> list[tuple[int, int]]:
    """Rows ``[r0, r1)`` of each band: ``step`` rows, none of one row alone (the
    last one row joins the band before it). A band of one row whose scale group is
    the whole row makes each reduction a single output, which torch splits across
    threads and so sums in another order than in the whole tensor (HQQ's sums)."""
    step = max(2, step)
    out = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
    if len(out) > 1 and out[-1][1] - out[-1][0] == 1:
        out[-2:] = [(out[-2][0], rows)]
    return out


def _quantized_band(module: Any, weight: Any, config: Any, handler: Any, source: Any, r0: int, r1: int,
                    extra_repr: Any, nan_whole: bool = False) -> Any:
    """Rows ``[r0, r1)`` of ``source`` quantized by ``handler`` on ``module`` (its
    weight left None: the band's full-precision values go with the return).

    Raises:
        _NaNUnderAffine: ``nan_whole`` and the band holds a NaN.
    """
    import torch

    values = source.read(r0, r1, None)
    if nan_whole and bool(torch.isnan(values).any()):
        raise _NaNUnderAffine
    restore_extra_repr(module, extra_repr)  # torchao wraps it once per call: once in all, as upstream
    module.weight = torch.nn.Parameter(values, requires_grad=weight.requires_grad)
    handler(module, config)
    band = module.weight
    module.weight = None
    return band


def hqq_search(module: Any, weight: Any, config: Any, handler: Any, source: Any, planned: list[tuple[int, int]],
               extra_repr: Any) -> Search:
    """The whole tensor's HQQ scale-only iterations run over ``planned`` bands of
    ``source`` (:class:`~ptdstream.weightless.hqq_bands.Search`): torchao's
    arguments probed on the first band, then its iterations to the whole
    tensor's stop, the bands' values held while they run when they come to at
    most :data:`HELD_NBYTES` in float32.

    Raises:
        _NotRowWise: torchao's handler did not call its HQQ function on the first band,
            or the function it called has no ``iters`` and ``early_stop_tol`` defaults.
    """
    if not planned:
        raise _NotRowWise
    try:
        search = probed(lambda: _quantized_band(module, weight, config, handler, source, *planned[0], extra_repr))
    finally:
        module.weight = None
        restore_extra_repr(module, extra_repr)
    if search is None:  # no HQQ call, or a function in torchao's place without its defaults: the tensor whole
        raise _NotRowWise
    held: list[Any] | None = None
    if weight.numel() * 4 <= HELD_NBYTES:
        held = [source.read(r0, r1, None) for r0, r1 in planned]
    search.run((lambda i: held[i]) if held is not None else (lambda i: source.read(*planned[i], None)), planned)
    return search


def _append_band(files: RowFiles, band: Any, first: tuple[Any, list[str], Any] | None, r0: int,
                 r1: int) -> tuple[Any, list[str], Any]:
    """Append the inner tensors of ``band`` (rows ``[r0, r1)``, torchao's tensor) to
    ``files``; returns the first band's type, inner names and metadata (this one's
    when ``first`` is None).

    Raises:
        _NotRowWise: not a tensor subclass, another type or metadata than the first
            band's, or an inner tensor that is not one row per row of the weight.
    """
    if not adapter.is_traceable_wrapper_subclass(band):
        raise _NotRowWise
    names, meta = band.__tensor_flatten__()
    mine = (type(band), list(names), meta)
    if first is not None and mine != first:
        raise _NotRowWise
    for name in names:
        part = getattr(band, name)
        if adapter.is_traceable_wrapper_subclass(part) or part.dim() == 0 or part.shape[0] != r1 - r0:
            raise _NotRowWise
        files.append(name, part.contiguous())
    return first or mine


def quantize_in_bands(module: Any, weight: Any, config: Any, handler: Any, source: Any, step: int, folder: str,
                      extra_repr: Any, hqq: bool) -> Any:
    """The quantized ``weight`` (storage-less, its rows in ``source``: a
    :class:`~ptdstream.weightless.convert.RowReader`), made band by band of about
    ``step`` rows by torchao's ``handler`` on ``module``, each band's inner tensors
    appended to files in ``folder``; ``hqq``: the config is HQQ scale-only (the whole
    tensor's iterations run over the bands first: :func:`hqq_search`). None (``module``'s
    ``extra_repr`` restored, the files dropped) when a band's inner tensors are not
    one row per row of the weight, or a band holds a NaN under the ``affine``
    algorithm (its NaN scale's bits are the whole tensor's only: :class:`_NaNUnderAffine`)."""
    try:
        return _in_bands(module, weight, config, handler, source, step, folder, extra_repr, hqq)
    except _NotRowWise:
        restore_extra_repr(module, extra_repr)
        return None


def _in_bands(module: Any, weight: Any, config: Any, handler: Any, source: Any, step: int, folder: str,
              extra_repr: Any, hqq: bool) -> Any:
    planned = bands(weight.shape[0], step)
    if not hqq:
        return _each_band(module, weight, config, handler, source, planned, folder, extra_repr, hqq)
    search = hqq_search(module, weight, config, handler, source, planned, extra_repr)
    done, quantized = answered(search, lambda: _each_band(module, weight, config, handler, source, planned, folder,
                                                          extra_repr, hqq))
    if done:
        return quantized
    restore_extra_repr(module, extra_repr)  # another torchao's loop: its own function, the whole tensor's iterations
    with fixed_iterations(search.stop):
        return _each_band(module, weight, config, handler, source, planned, folder, extra_repr, hqq)


def _each_band(module: Any, weight: Any, config: Any, handler: Any, source: Any, planned: list[tuple[int, int]],
               folder: str, extra_repr: Any, hqq: bool) -> Any:
    first: tuple[Any, list[str], Any] | None = None
    with RowFiles(folder) as files:
        for r0, r1 in planned:
            first = _append_band(files, _quantized_band(module, weight, config, handler, source, r0, r1,
                                                        extra_repr, nan_whole=not hqq), first, r0, r1)
        if first is None:  # no band at all (no rows): quantize the tensor whole
            raise _NotRowWise
        return _unflattened(first, files.finish(), weight)


def _unflattened(first: tuple[Any, list[str], Any], inner: dict[str, Any], weight: Any) -> Any:
    cls, _, meta = first
    return cls.__tensor_unflatten__(inner, meta, tuple(weight.shape), weight.stride())
