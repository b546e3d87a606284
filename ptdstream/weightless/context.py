"""``weights_from(checkpoint)``: export, lower, emit and save while no weight is held.

The route, for the portable backend with external constants
(``ExecutorchBackendConfig(external_constants=True)``)::

    with ptdstream.weights_from("model.safetensors") as weights:
        model = weights.model(lambda: MyModel(config))      # storage-less parameters
        program = weights.bind(torch.export.export(model, example_inputs))
        manager = to_edge(program).to_executorch(ExecutorchBackendConfig(external_constants=True))
        ptdstream.save(manager, "out/model.pte")

1) :meth:`WeightsFrom.model` builds the model with storage-less cpu parameters
(:mod:`ptdstream.weightless.storage_less`); 2) ``torch.export`` traces it (no
parameter is cloned: there are no bytes); 3) :meth:`WeightsFrom.bind` binds
each storage-less constant by FQN to the checkpoint's memory-mapped tensor,
after checking them all (:mod:`ptdstream.weightless.binding`); 4) ``to_edge``
and ``to_executorch`` run as usual; inside the context the emitter keeps each
constant as a reference to the mapped tensor
(:func:`ptdstream.hooks.emitter.constants_by_reference`: its SHA-256, and so
upstream's dedup classes, streamed from the checkpoint in pieces, pages paged
out), and a program that still holds a storage-less constant is refused by
name before emission (so no manager, and nothing written, ever holds one);
5) ``ptdstream.save`` streams each weight from the checkpoint through its ring.

XNNPACK with weights tagged to a ``.ptd`` (``delegate_external_constants_pass_unlifted``
on ``program.module()``, re-exported, then bound) works the same way: inside the
context XNNPACK keeps unchanged weights by reference and its per-partition copy
shares the bound tensors (:mod:`ptdstream.weightless.delegates`).

What needs the weights' values while exporting is not done per weight:
``constant_prop_pass`` run before :meth:`WeightsFrom.bind` leaves folded
constants that :meth:`~WeightsFrom.bind` refuses by name; run after it, it
computes them from the mapped checkpoint (the same bytes, but the folded
constants are held in memory). Quantization (torchao) is not supported (not tried
on storage-less weights); XNNPACK's packing of transformed weights (4-bit, NHWC or swapped convolutions)
reads them from the mapping and copies them, as upstream does. Checkpoints: safetensors (a file,
or a Hugging Face sharded folder) and weights-only ``torch.save``; DCP is
refused (its tensors are loaded, not mapped). The checkpoint's dtype must be the
export's (not converted).

Patches: the emitter's (see ``constants_by_reference``), XNNPACK's (see
``xnnpack_constants_by_reference`` and :mod:`~ptdstream.weightless.delegates`)
and executorch's ``exir/program/_program.py`` module global ``emit_program`` (a
check of its input first), all scoped through :mod:`ptdstream.upstream.patching`, restored
when the last context exits. Contexts nest and may be used from several
threads at once (each holds its own checkpoint); the emission check applies in
every thread while any context is open (it refuses only what upstream's
emitter cannot emit).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..errors import FormatError, StateError
from ..hooks.emitter import constants_by_reference
from ..sources.checkpoint import Checkpoint, open_checkpoint
from ..upstream import adapter
from ..upstream.patching import shadowed
from .binding import UnboundConstantError, bind_programs, plan_binding, unbound_constants
from .delegates import add_bound, bound_weights, sharing_bound_weights
from .storage_less import storage_less_model

__all__ = ["WeightsFrom", "weights_from"]

#: Checkpoint kinds whose tensors are memory-mapped views (bound without a read).
MAPPED_KINDS = ("safetensors", "torch")


class WeightsFrom:
    """What :func:`weights_from` yields: the checkpoint, and the three steps
    :meth:`model`, :meth:`bind` (or :meth:`export`, both at once).

    Valid only inside its ``with`` block (``StateError`` after).
    """

    def __init__(self, checkpoint: Checkpoint, key_map: Mapping[str, str] | None, allow_extra: bool) -> None:
        self.checkpoint = checkpoint
        self.key_map = dict(key_map or {})
        self.allow_extra = allow_extra
        self._open = True
        self._bound: list[Any] = []  # every tensor bound (kept alive: XNNPACK's copy shares them by id)

    def _check_open(self, what: str) -> None:
        if not self._open:
            raise StateError(f"{self.checkpoint.path}: weights_from(...).{what}() called after its with block "
                             "ended: call it inside the block")

    def model(self, factory_or_module: Callable[[], Any] | Any) -> Any:
        """A model with storage-less parameters, from a factory or a meta-device
        module: see :func:`ptdstream.weightless.storage_less.storage_less_model`."""
        self._check_open("model")
        return storage_less_model(factory_or_module)

    def bind(self, programs: Any, key_map: Mapping[str, str] | None = None) -> Any:
        """Bind every storage-less constant of ``programs`` (an ``ExportedProgram``
        or ``{method: ExportedProgram}``, changed in place and returned) to the
        checkpoint's tensor of its FQN (through the context's ``key_map``, then
        this call's ``key_map``, which wins for the FQNs it names).

        Checks everything first: nothing is bound if anything is wrong.

        Raises:
            BindingError: every missing key, extra key, wrong dtype or shape, at once.
        """
        self._check_open("bind")
        methods = programs if isinstance(programs, Mapping) else {"forward": programs}
        plan = plan_binding(methods, self.checkpoint, {**self.key_map, **(key_map or {})}, self.allow_extra)
        add_bound(self._bound, bind_programs(methods, self.checkpoint, plan, self._mapped_tensor))
        return programs

    def export(self, model: Any, args: tuple, **kwargs: Any) -> Any:
        """``bind(torch.export.export(model, args, **kwargs))``."""
        import torch

        return self.bind(torch.export.export(model, args, **kwargs))

    def _mapped_tensor(self, key: str) -> Any:
        # The checkpoint's own mapped view of the key (Checkpoint keeps one per key).
        return self.checkpoint._tensors[key]  # type: ignore[attr-defined]  # both MAPPED_KINDS keep _tensors


def _checking_emit(real: Callable[..., Any]) -> Callable[..., Any]:
    """``emit_program`` that first refuses storage-less constants by name."""

    @functools.wraps(real)
    def emit_program(methods, *args, **kwargs):
        programs = methods if isinstance(methods, Mapping) else {"forward": methods}
        left = unbound_constants(programs)
        if left:
            raise UnboundConstantError(left, "to_executorch")
        return real(methods, *args, **kwargs)

    return emit_program


@contextlib.contextmanager
def weights_from(checkpoint: str | os.PathLike[str], key_map: Mapping[str, str] | None = None, *,
                 format: str = "auto", allow_extra: bool = False) -> Iterator[WeightsFrom]:
    """Export with storage-less parameters, bound at the end to ``checkpoint``'s tensors.

    ``checkpoint``: a ``.safetensors`` file, a Hugging Face folder or index, or a
    weights-only ``torch.save`` file (:func:`ptdstream.sources.checkpoint.open_checkpoint`,
    ``format`` as there). ``key_map``: ``{fqn: checkpoint key}`` for names that
    differ. ``allow_extra``: ignore checkpoint keys no constant uses.
    Host memory: the checkpoint's metadata and, while saving, the ring; weights
    are read in pieces from the mapping and paged out. See the module docstring
    for the whole route and what it refuses.

    Raises:
        FormatError: a DCP checkpoint (not mapped), or one that cannot be read.
        FileNotFoundError: nothing at ``checkpoint``.
    """
    opened = open_checkpoint(os.fspath(checkpoint), format)
    with opened:
        if opened.kind not in MAPPED_KINDS:
            raise FormatError(f"{opened.path}: a {opened.kind} checkpoint is loaded, not memory-mapped: "
                              f"weights_from takes {' or '.join(MAPPED_KINDS)} checkpoints")
        module = adapter.program_module()
        weights = WeightsFrom(opened, key_map, allow_extra)
        try:
            with bound_weights(weights._bound), constants_by_reference(), sharing_bound_weights(), \
                    shadowed(module, "emit_program", _checking_emit(module.emit_program)):
                yield weights
        finally:
            weights._open = False
