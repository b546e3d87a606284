"""The check executorch's ``emit_program`` runs first, for the process, from the
first :func:`~ptdstream.weightless.weights_from` on.

Upstream's emitter reads every constant's bytes (``exir/emit/_emitter.py``) and
has none to read from a storage-less tensor (``NULL pointer access``), nor the
values a quantization of storage-less weights needs: both are refused by name
here, before anything is emitted. A checkpoint file changed since a context
opened it is refused before and after emission, for the contexts open in this
thread and for those, in any thread, that bound a tensor of the program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from .binding import unbound_constants
from .errors import QuantizationNeedsValuesError, UnboundConstantError
from .lowering import bind_found, contexts_holding, open_contexts, release_dead_programs, release_file_pages
from .quantization import quantized_constants

__all__ = ["checking_emit"]


def checking_emit(real: Callable[..., Any]) -> Callable[..., Any]:
    """``emit_program`` that first refuses storage-less constants, and quantized
    ones made from storage-less weights, by name, and a checkpoint file changed
    since it was opened: of the contexts open in this thread and of those open in
    any thread that bound a tensor of the program, checked before and after the
    emission (which reads the bound tensors: upstream's copy in a thread outside
    the context, the digests by reference inside it)."""

    @functools.wraps(real)
    def emit_program(methods, *args, **kwargs):
        programs = methods if isinstance(methods, Mapping) else {"forward": methods}
        bind_found(programs)  # storage-less constants lowering did not see (none in the usual route)
        quantized = quantized_constants(programs)
        if quantized:
            raise QuantizationNeedsValuesError(quantized, "to_executorch")
        left = unbound_constants(programs)
        if left:
            raise UnboundConstantError(left, "to_executorch")
        holders = {weights: list(dict.fromkeys(weights.bound_keys + weights.quantized_keys))
                   for weights in [*open_contexts(), *contexts_holding(programs)]}
        for weights, keys in holders.items():
            weights.check_unchanged(keys, "before to_executorch emitted the program (nothing emitted)")
        if open_contexts():
            release_file_pages()  # those the last partition's packing read
            release_dead_programs()  # what lowering and the passes freed, and the programs they replaced
        emitted = real(methods, *args, **kwargs)
        for weights, keys in holders.items():
            weights.check_unchanged(keys, "while to_executorch emitted the program (its result dropped, "
                                          "nothing written)")
        return emitted

    return emit_program
