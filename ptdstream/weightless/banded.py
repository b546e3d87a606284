"""A large weight quantized band by band by torchao's handler, with the bytes of the whole tensor.

:func:`quantize_in_bands` sets each band of rows (:func:`bands`) as the module's
weight, runs torchao's handler of the config on it, appends the band's inner
tensors (``qdata``, ``scale``, ``zero_point``: one row per row of the weight) to
nameless files (:class:`~ptdstream.weightless.mapped_copy.RowFiles`) and frees
the band before reading the next one; the result is the tensor type torchao
made, over those files. Under ``hqq_scale_only`` a first pass over the bands
finds the iteration the whole tensor stops at; where that is torchao's last one
its bands are the tensor's, else a second pass runs exactly that many
(:mod:`ptdstream.weightless.hqq_bands`). Anything else than one row of
inner tensors per row, or a NaN in a band under the ``affine`` algorithm (torch's
min/max give a NaN scale other bits in a band), gives None (the caller quantizes
the tensor whole).
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..upstream import adapter
from .hqq_bands import Changes, fixed_iterations, recording_changes
from .mapped_copy import RowFiles

__all__ = ["bands", "hqq_first_pass", "quantize_in_bands", "restore_extra_repr"]


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


def hqq_first_pass(module: Any, weight: Any, config: Any, handler: Any, source: Any, step: int, extra_repr: Any,
                   files: RowFiles) -> tuple[Changes, tuple[Any, list[str], Any]]:
    """One pass over ``weight``'s bands through torchao's handler recording each
    iteration's changes (:func:`~ptdstream.weightless.hqq_bands.recording_changes`),
    each band's values (all of torchao's iterations) appended to ``files``: the
    changes (their :meth:`~ptdstream.weightless.hqq_bands.Changes.stop` is the
    whole tensor's; where :meth:`~ptdstream.weightless.hqq_bands.Changes.complete`,
    ``files`` hold its bytes) and the first band's tensor type, inner names and metadata.

    Raises:
        _NotRowWise: torchao did not call its HQQ function once per band as expected,
            or a band's inner tensors are not one row per row.
    """
    planned = bands(weight.shape[0], step)
    first = None
    with recording_changes() as changes:
        for r0, r1 in planned:
            first = _append_band(files, _quantized_band(module, weight, config, handler, source, r0, r1, extra_repr),
                                 first, r0, r1)
    if first is None or changes.bands != len(planned):
        raise _NotRowWise
    return changes, first


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
    appended to files in ``folder``; ``hqq``: the config is HQQ scale-only (a first
    pass, and a second one where the whole tensor stops early). None (``module``'s
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
    first: tuple[Any, list[str], Any] | None = None
    fixed: Any = contextlib.nullcontext()
    if hqq:
        with RowFiles(folder) as files:
            changes, first = hqq_first_pass(module, weight, config, handler, source, step, extra_repr, files)
            if changes.complete():  # the first pass's bands are the tensor's bytes
                return _unflattened(first, files.finish(), weight)
        fixed, first = fixed_iterations(changes.stop()), None
    with RowFiles(folder) as files, fixed:
        for r0, r1 in bands(weight.shape[0], step):
            first = _append_band(files, _quantized_band(module, weight, config, handler, source, r0, r1,
                                                        extra_repr, nan_whole=not hqq), first, r0, r1)
        if first is None:  # no band at all (no rows): quantize the tensor whole
            raise _NotRowWise
        return _unflattened(first, files.finish(), weight)


def _unflattened(first: tuple[Any, list[str], Any], inner: dict[str, Any], weight: Any) -> Any:
    cls, _, meta = first
    return cls.__tensor_unflatten__(inner, meta, tuple(weight.shape), weight.stride())
