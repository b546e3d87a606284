"""Programs bound as they reach lowering: an existing export script inside one ``with`` line.

While a :func:`~ptdstream.weightless.weights_from` context is open in a thread
(or a :func:`~ptdstream.weightless.pretrained_without_weights` one), in that
thread:

* ``torch.export`` (``torch.export.export`` calls ``torch.export._trace._export``,
  looked up when called, so ``from torch.export import export`` is seen too)
  first makes a module's meta parameters and meta persistent buffers
  storage-less cpu tensors, in place, as :meth:`WeightsFrom.model
  <ptdstream.weightless.WeightsFrom.model>` does (a model the user built under
  ``torch.device("meta")`` traces as it would with weights; a meta
  non-persistent buffer is refused by name, :class:`~ptdstream.weightless.MetaBufferError`);
* ``ExportedProgram.run_decompositions``, where ``to_edge`` and
  ``to_edge_transform_and_lower`` begin (``exir/program/_program.py``), first
  binds the program's storage-less constants (:func:`bind_found`), and so does
  emission (``to_executorch``: :mod:`ptdstream.weightless.context`'s check of
  ``emit_program``) for any left.

Until it is lowered a program stays storage-less, so a second
``torch.export`` of its ``program.module()`` (XNNPACK's tagging of external
weights) traces storage-less tensors too. Binding is idempotent (a constant
bound already counts as bound: :func:`~ptdstream.weightless.binding.plan_binding`),
so ``weights.export`` / ``weights.bind`` before it change nothing.

Which context binds a constant (:func:`bind_found`): the innermost open
context of the thread that recorded that very tensor (``WeightsFrom.record``:
the Hugging Face route's keys, transformers' renamed and fused keys), else the
innermost context that binds by name (every ``weights_from`` the user opens).
A program whose constants two contexts claim is refused by name.

Before each such export, the module's large buffers (the static KV cache) are
moved to files of the innermost context's folder in place
(:mod:`ptdstream.weightless.buffers`). They and the quantized weights
(:mod:`ptdstream.weightless.quantization`: plain tensors over shared mappings
of their own files) are traced as storage-less ones are: while
a ``torch.export`` in an open context runs, dynamo's ``_clone_input`` (which a
strict export calls to copy every real tensor it wraps into its real-value
cache, ``torch/_dynamo/variables/builder.py``) returns such a tensor itself,
so their bytes are never copied to memory; the cache is read only for values a
trace branches on, and nothing writes it. The pages that tracing, the
decompositions or XNNPACK's packing read of the files a context wrote to its
folder (quantized weights, converted copies, folded constants, packed weights:
shared mappings) are unmapped from the process after each
``torch.export``, each ``run_decompositions``, each XNNPACK partition's
``preprocess`` (:mod:`ptdstream.weightless.delegates`) and before emission
(:func:`release_file_pages`; the page cache keeps them).

The C heap (:func:`trim_heap`, glibc's ``malloc_trim``) is handed back to the
system after each ``torch.export``, before and after each ``run_decompositions``
and before emission; before each ``run_decompositions`` and before emission,
:func:`release_dead_programs` first drops upstream's references to programs no
step uses any more and collects them (and each ``torch.export``, in any thread
while a context is open, removes the graph dynamo's capture left in its module
globals: :mod:`ptdstream.hooks.program_caches`): tracing and lowering free many blocks of a few MiB that
glibc would otherwise keep resident until the process ends; and a context
opening fixes glibc's mmap threshold (:func:`fix_heap`), so that the larger
blocks never sit in the heap at all (at optimum's usual flags, without it about
75 MiB per decoder layer stayed; benchmarks/README.md).

Patches (through :mod:`ptdstream.upstream.patching`, restored by the last
exit): ``torch.export._trace._export`` (registered in
:mod:`ptdstream.upstream.names`), ``torch.export.ExportedProgram.run_decompositions``
and, while each export runs, ``torch._dynamo.variables.builder._clone_input``.
They act only in threads with an open context; elsewhere the originals run.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..hooks.program_caches import counting_export, forget_node_caches
from ..system.heap import fix_mmap_threshold, malloc_trim
from ..upstream import adapter
from ..upstream.patching import shadowed
from .binding import needing_values
from .errors import BindingError
from .storage_less import meta_to_storage_less

__all__ = ["TRIM_HEAP", "bind_found", "binding_at_lowering", "contexts_holding", "fix_heap", "open_contexts", "opened",
           "release_dead_programs", "release_file_pages", "trim_heap"]

_local = threading.local()  # .stack: the WeightsFrom contexts open in this thread, innermost last
_lock = threading.Lock()
_everywhere: list[Any] = []  # the WeightsFrom contexts open in any thread, in the order opened

#: hand the C heap back at each lowering step (False: as upstream; benchmarks compare both)
TRIM_HEAP = True


def trim_heap() -> None:
    """:func:`ptdstream.system.heap.malloc_trim` when :data:`TRIM_HEAP` (the weightless route's steps call it)."""
    if TRIM_HEAP:
        malloc_trim()


def release_dead_programs() -> None:
    """Drop upstream's references to programs no step uses any more
    (:func:`ptdstream.hooks.program_caches.forget_node_caches`), collect the
    cycles a replaced program leaves (``gc.collect``: a graph, its module and its
    nodes refer to one another, so they wait for the oldest generation's collection
    otherwise) and :func:`trim_heap`, when :data:`TRIM_HEAP` (all three)."""
    if TRIM_HEAP:
        forget_node_caches()
        gc.collect()
        trim_heap()


def fix_heap() -> None:
    """:func:`ptdstream.system.heap.fix_mmap_threshold` when :data:`TRIM_HEAP` (a context opening calls it)."""
    if TRIM_HEAP:
        fix_mmap_threshold()


def release_file_pages() -> None:
    """Each context open in this thread unmaps the pages read of the files it wrote
    (:meth:`~ptdstream.weightless.WeightsFrom.release_file_pages`)."""
    for weights in open_contexts():
        weights.release_file_pages()


def _holds_file_tensor(tensor: Any) -> bool:
    return any(w.holds_file_tensor(tensor) for w in open_contexts())


def _not_cloning_file_tensors(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def _clone_input(value: Any, fake_mode: Any) -> Any:
        import torch

        # plain tensors only: a FakeTensor, FunctionalTensor or subclass has no data pointer to match
        if type(value) in (torch.Tensor, torch.nn.Parameter) and value.device.type == "cpu" \
                and not value.is_nested and _holds_file_tensor(value):
            return value  # as a storage-less weight is: its file's bytes are never copied to memory
        return real(value, fake_mode)

    return _clone_input


def open_contexts() -> list[Any]:
    """The :class:`~ptdstream.weightless.WeightsFrom` contexts open in this thread, innermost last."""
    stack: list[Any] = _local.__dict__.setdefault("stack", [])
    return stack


@contextlib.contextmanager
def opened(weights: Any) -> Iterator[None]:
    """``weights`` is open in this thread until exit (its programs bound at lowering)."""
    stack = open_contexts()
    stack.append(weights)
    with _lock:
        _everywhere.append(weights)
    try:
        yield
    finally:
        if weights in stack:
            stack.remove(weights)
        with _lock:
            _everywhere.remove(weights)


def contexts_holding(programs: Mapping[str, Any]) -> list[Any]:
    """The :class:`~ptdstream.weightless.WeightsFrom` contexts open in any thread
    that bound a tensor ``programs`` ({method: ExportedProgram}) hold in their
    ``state_dict`` or ``constants``: whatever thread emits a program, the checks
    that protect its bound tensors are theirs (a ``ThreadPoolExecutor`` hand-off)."""
    tensors = [t for ep in programs.values() for table in (ep.state_dict, ep.constants) for t in table.values()]
    with _lock:
        everywhere = list(_everywhere)
    return [w for w in everywhere if any(w.owns(t) for t in tensors)]


def bind_found(programs: Mapping[str, Any]) -> int:
    """Bind the storage-less constants of ``programs`` ({method: ExportedProgram},
    changed in place) that need values, through the context that claims them
    (see the module docstring); returns how many constants were storage-less.
    Nothing happens outside a context, or when no context claims them (the
    emission check names them then).

    Raises:
        BindingError: every missing key, dtype, shape or dim order problem at
            once (checkpoint keys no constant uses are ignored here: a script
            may lower its methods, or its models, one at a time); two contexts
            claiming constants of one program.
        IntegrityError, OSError: as :meth:`~ptdstream.weightless.WeightsFrom.bind`.
    """
    stack = open_contexts()
    if not stack:
        return 0
    for weights in stack:
        weights.adopt_quantized(programs)  # torchao's quantized weights made in a context: bound already
    found = needing_values(programs)
    if not found:
        return 0
    by_name = next((w for w in reversed(stack) if w.by_name), None)
    owners: dict[int, Any] = {}
    for tensor in found:
        owner = next((w for w in reversed(stack) if w.owns(tensor)), by_name)
        if owner is not None:
            owners[id(owner)] = owner
    if len(owners) > 1:
        paths = ", ".join(sorted(w.checkpoint.path for w in owners.values()))
        raise BindingError(paths, [f"one program holds weights of {len(owners)} checkpoints ({paths}): export "
                                   "each model on its own, or bind with weights.bind(program, key_map=...)"])
    for owner in owners.values():
        owner.bind_found(programs)
    return len(found)


def _lowering(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def run_decompositions(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not open_contexts():
            return real(self, *args, **kwargs)
        bind_found({"forward": self})
        release_dead_programs()  # the programs the last steps replaced, before this one makes another
        try:
            return real(self, *args, **kwargs)
        finally:
            release_file_pages()  # those the decompositions read
            trim_heap()  # what the decompositions freed

    return run_decompositions


def _exporting(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def _export(mod: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        if not open_contexts():
            with _lock:
                anywhere = bool(_everywhere)
            # another thread's context: counted, so that its removal waits for this capture; none open
            # anywhere (a reference to this wrapper kept past the last exit): upstream's behaviour
            with counting_export() if anywhere else contextlib.nullcontext():
                return real(mod, *args, **kwargs)
        if isinstance(mod, torch.nn.Module):
            meta_to_storage_less(mod)
            open_contexts()[-1].move_large_buffers(mod)
        builder = adapter.dynamo_builder_module()
        try:
            with counting_export(), \
                    shadowed(builder, "_clone_input", _not_cloning_file_tensors(builder._clone_input)):
                return real(mod, *args, **kwargs)
        finally:
            release_file_pages()  # those tracing read (a subclass's own clone, say)
            trim_heap()

    return _export


@contextlib.contextmanager
def binding_at_lowering() -> Iterator[None]:
    """While active, in threads with an open context, ``torch.export`` makes meta
    tensors storage-less and ``run_decompositions`` binds (see the module docstring)."""
    import torch

    trace = adapter.export_trace_module()
    program_class = torch.export.ExportedProgram
    with shadowed(program_class, "run_decompositions", _lowering(program_class.run_decompositions)), \
            shadowed(trace, "_export", _exporting(trace._export)):
        yield
