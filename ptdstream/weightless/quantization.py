"""Quantization as the weights stream: torchao's ``quantize_`` on storage-less weights, one weight at a time.

torchao's ``quantize_`` computes each quantized weight (integer data, scales,
zero points) from the weight's values. Inside
:func:`~ptdstream.weightless.weights_from` (in the thread where it is open),
the walk every ``quantize_`` with a config makes (``quant_api``'s module global
``_replace_with_custom_fn_if_matches_filter``, looked up when ``quantize_``
runs: however ``quantize_`` was imported, optimum-executorch's
``quantize_model_`` included) is shadowed by :func:`streaming_walk`. On a
model whose targeted weights are storage-less, it:

1. finds, before anything is read, every weight the call would quantize
   (``filter_fn``, torchao's default ``_is_linear``, walked as torchao walks:
   a module picked is not descended into) and its checkpoint key (the key a
   context recorded for that tensor, the Hugging Face route's; else its FQN
   in the model given, through ``key_map``): a config not covered
   (:func:`~ptdstream.weightless.quantized_configs.uncovered_reason`) is refused by name
   (:class:`~ptdstream.weightless.QuantizationNeedsValuesError`), a weight no
   checkpoint key fits by :class:`~ptdstream.weightless.BindingError`, the
   model unchanged;
2. runs torchao's own walk with ``filter_fn`` wrapped, so the modules
   are visited in torchao's order: at each storage-less target, the weight is
   read from the checkpoint's mapping (or a converted copy, for DCP and fused
   keys) and converted to the model's dtype (``copy_``: bfloat16 to float32 as
   ``from_pretrained(dtype=float32)`` does; a NaN's payload bits may differ,
   see :mod:`ptdstream.weightless.convert`), set as the module's weight and
   quantized by torchao's handler of the config (its own code, on that one
   module); the quantized tensor's inner tensors (``qdata``, ``scale``,
   ``zero_point``) are written to nameless files of the context's folder and
   mapped back (:mod:`ptdstream.weightless.mapped_copy`), the full-precision
   weight released, before the next module;
3. a weight larger than :data:`LARGE_NBYTES` (in the model's dtype) under a
   config whose scales are per row or per group of a row
   (``Int8DynamicActivationIntxWeightConfig``, ``IntxWeightOnlyConfig``:
   torchao's ``IntxUnpackedToInt8Tensor``) is quantized in bands of rows of
   about :data:`BAND_NBYTES`, each band's inner tensors appended to the files:
   the same bytes as the whole tensor quantized at once (rows are quantized
   independently; under the ``affine`` algorithm a weight with a NaN is
   quantized whole: torch's min/max give a NaN scale other bits in a band).
   Under ``hqq_scale_only``, whose early stop is taken over the whole tensor,
   the whole tensor's iterations run over the bands, iteration by iteration
   (only the scales kept between them), to the one it stops at; each band's
   levels at those scales are its bytes (:mod:`ptdstream.weightless.hqq_bands`,
   checked against torchao's own function once per kind of weight). While each weight is quantized,
   blocks under 32 MiB come from the C heap again
   (:func:`ptdstream.system.heap.reusing_heap_blocks`). The CUDA backend's int4
   tile-packed quantizes one whole tensor at a time.

The quantized tensors are plain file-backed tensors: ``unwrap_tensor_subclass``
(optimum runs it) parametrizes them as usual, ``torch.export`` shares them, and
each program is bound as it reaches lowering: a tensor whose storage is one of
them counts as bound to its checkpoint key
(:meth:`~ptdstream.weightless.WeightsFrom.adopt_quantized`; XNNPACK's copy
shares it, the emitter and the save stream it from its file). Tied weights:
optimum quantizes ``embed_tokens`` (8w) first, which gives it a new parameter
and so unties ``lm_head``, then ``lm_head`` (8da4w): each is read from the
checkpoint key and quantized in that order, as upstream does. The keys
quantized are checked unchanged as bound keys are (before emission, at exit).

``device`` (``quantize_``'s argument): where each streamed weight is read to
and quantized (``"cuda"``: the CUDA backend's int4; its quantized tensors stay
there, nothing written to files); the storage-less model is not moved.

Outside a context (or in another thread), a storage-less target is refused by
name; a ``FqnToConfig`` (which ``quantize_`` applies without the walk, through
``_fqn_to_config_handler``, shadowed by :func:`refusing_storage_less`) is refused
by name; a ``PerGroup`` size that does not divide a weight is named before
anything is read (:class:`~ptdstream.weightless.QuantizationShapeError`); a
quantized constant made from storage-less weights anyway (``quantize_``
imported before the context opened) is refused by
:meth:`~ptdstream.weightless.WeightsFrom.bind` and before emission
(:func:`derived_from_storage_less`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..system.heap import reusing_heap_blocks
from ..upstream import adapter
from ..upstream.patching import shadowed
from .banded import quantize_in_bands, restore_extra_repr
from .convert import convertible
from .errors import BindingError, QuantizationNeedsValuesError, QuantizationShapeError
from .hqq_bands import routing_hqq
from .lowering import open_contexts, trim_heap
from .mapped_copy import mapped_copy
from .quantized_configs import ROW_WISE, group_size, grouped_dim, hqq_refuses, named, row_local, uncovered_reason
from .storage_less import derived_from_storage_less, is_storage_less

__all__ = ["BAND_NBYTES", "LARGE_NBYTES", "quantized_constants", "refusing_storage_less", "streaming_quantization",
           "streaming_walk"]

#: A weight larger than this (bytes in the model's dtype) is quantized in bands of rows, where the config allows.
LARGE_NBYTES = 2 << 20
#: About the bytes of one band (rows of the weight in the model's dtype): small enough that HQQ's iterations
#: run in the CPU's caches (bands of 1 MiB quantized a 14336 x 4096 weight 3x faster than bands of 16 MiB),
#: its temporaries reused from the C heap.
BAND_NBYTES = 1 << 20

#: Whether this torchao's HQQ scale-only can be routed (:func:`streaming_quantization` found its module global).
_HQQ_BANDS = False


def _hqq(config: Any) -> bool:
    """Whether ``config`` is a row-wise config under ``hqq_scale_only`` (banded with
    the whole tensor's stop iteration found first: :mod:`ptdstream.weightless.hqq_bands`)."""
    return (_HQQ_BANDS and type(config).__name__ in ROW_WISE
            and named(config.intx_choose_qparams_algorithm, "hqq_scale_only"))


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


def _under(fqn: str, prefix: str) -> bool:
    return prefix == "" or fqn == prefix or fqn.startswith(prefix + ".")


def _targets(model: Any, chosen: Any) -> list[tuple[str, Any, Any]]:
    """``(module fqn, module, weight)`` of each module ``quantize_`` would quantize
    whose ``weight`` is storage-less, in torchao's order
    (``quant_api._replace_with_custom_fn_if_matches_filter``: a module picked
    is not descended into)."""
    out: list[tuple[str, Any, Any]] = []

    def walk(module: Any, fqn: str) -> None:
        if chosen(module, fqn):
            weight = module._parameters.get("weight")
            if weight is not None and is_storage_less(weight):
                out.append((fqn, module, weight))
            return
        for name, child in module.named_children():
            walk(child, f"{fqn}.{name}" if fqn else name)

    walk(model, "")
    return out


def _key_of(contexts: list[Any], weight: Any, fqn: str) -> tuple[Any, str | None]:
    """The context that binds ``weight`` (``fqn``: its name in the model given)
    and its checkpoint key there (None: that context holds no such key)."""
    for weights in reversed(contexts):
        if weights.owns(weight):
            return weights, weights.key_of(weight)
    by_name = next((w for w in reversed(contexts) if w.by_name), contexts[-1])
    key = by_name.key_map.get(fqn, fqn)
    return by_name, key if key in by_name.checkpoint.entries else None


def _record_tied(model: Any, contexts: list[Any]) -> None:
    """A storage-less parameter ``model`` holds under several names (a tied
    embedding and head) of which exactly one is a checkpoint key: recorded under
    that key by the context that binds by name, so that the head still finds it
    once quantizing the embedding has untied them (the checkpoint keeps one key
    of a tied pair, as ``save_pretrained`` does)."""
    aliases: dict[int, tuple[Any, list[str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if is_storage_less(param):
            aliases.setdefault(id(param), (param, []))[1].append(name)
    by_name = next((w for w in reversed(contexts) if w.by_name), contexts[-1])
    for param, names in aliases.values():
        if len(names) < 2 or any(w.owns(param) for w in contexts):
            continue
        keys = {by_name.key_map.get(n, n) for n in names} & set(by_name.checkpoint.entries)
        if len(keys) == 1:
            by_name.record(param, keys.pop())


class _Plan:
    """The weights one ``quantize_`` call streams: each module's context, key and weight."""

    def __init__(self, config: Any, targets: list[tuple[str, Any, Any]], contexts: list[Any]) -> None:
        self.config = config
        self.entries: dict[int, tuple[str, Any, str, Any]] = {}  # id(module) -> (fqn, context, key, weight)
        problems: dict[Any, list[str]] = {}
        misfits: list[str] = []
        for fqn, module, weight in targets:
            name = f"{fqn}.weight" if fqn else "weight"
            weights, key = _key_of(contexts, weight, name)
            if key is None:
                problems.setdefault(weights, []).append(
                    f"missing: {name!r} (quantized by quantize_) needs checkpoint key "
                    f"{weights.key_map.get(name, name)!r}, which the checkpoint does not hold")
                continue
            entry = weights.checkpoint.entries[key]
            where = f"{name!r} <- key {key!r} ({entry.where})"
            if entry.dtype != weight.dtype and not convertible(entry.dtype, weight.dtype):
                problems.setdefault(weights, []).append(
                    f"dtype: {where}: the checkpoint holds {entry.dtype}, quantize_ needs {weight.dtype}")
            elif tuple(entry.shape) != tuple(weight.shape):
                problems.setdefault(weights, []).append(
                    f"shape: {where}: the checkpoint holds {list(entry.shape)}, the model {list(weight.shape)}")
            else:
                self.entries[id(module)] = (fqn, weights, key, weight)
                group, dim = group_size(config), grouped_dim(config, weight)
                if group and weight.dim() and weight.shape[dim] % group and not hqq_refuses(config, weight):
                    what = "its last dimension" if dim == weight.dim() - 1 else f"its dimension {dim} (input channels)"
                    misfits.append(f"{where} {str(weight.dtype).replace('torch.', '')}{list(weight.shape)}: group "
                                   f"size {group} does not divide {what} ({weight.shape[dim]})")
        for weights, found in problems.items():
            raise BindingError(weights.checkpoint.path, found)
        if misfits:
            raise QuantizationShapeError(f"torchao quantize_ ({type(config).__name__})", misfits)


def _quantize_one(module: Any, fqn: str, weights: Any, key: str, weight: Any, config: Any, device: Any) -> None:
    """Quantize ``module.weight`` (storage-less ``weight``) from checkpoint key ``key`` with torchao's handler."""
    import torch

    handler = adapter.quantize_handler(config)
    rows = weight.shape[0] if weight.dim() else 1
    row_nbytes = weight[0].numel() * weight.element_size() if weight.dim() else weight.element_size()
    on_cpu = device is None or torch.device(device).type == "cpu"
    # HQQ's torchao function takes 2-D weights alone: a 4-D one goes whole, to torchao's own error
    banded = (on_cpu and (row_local(config) or (_hqq(config) and weight.dim() == 2)) and weight.dim() >= 2
              and rows * row_nbytes > LARGE_NBYTES)
    weights.check_unchanged([key], f"before key {key!r} was quantized")
    extra_repr = module.__dict__.get("extra_repr")
    try:
        _quantize_from(module, weights, key, weight, config, device, handler, rows, row_nbytes, banded, extra_repr)
    except BaseException:  # an error or an interrupt: the module keeps its storage-less weight, as upstream keeps its
        module.weight = weight
        restore_extra_repr(module, extra_repr)
        raise
    weights.check_unchanged([key], f"while key {key!r} was quantized")
    if module.weight is not weight:
        weights.note_quantized(key, module.weight)
    trim_heap()  # the full-precision weight and torchao's intermediates, freed by now


def _quantize_from(module: Any, weights: Any, key: str, weight: Any, config: Any, device: Any, handler: Any,
                   rows: int, row_nbytes: int, banded: bool, extra_repr: Any) -> None:
    """Set ``module.weight`` to ``weight`` quantized from key ``key`` (in bands where
    ``banded``), or back to ``weight`` where torchao left it as it was."""
    import torch

    with weights.reading(key, weight.dtype) as source, reusing_heap_blocks():
        quantized = None
        if banded:
            quantized = quantize_in_bands(module, weight, config, handler, source,
                                          max(1, BAND_NBYTES // max(row_nbytes, 1)), weights.convert_dir.folder,
                                          extra_repr, _hqq(config))
        if quantized is None:
            module.weight = torch.nn.Parameter(source.read(0, rows, device), requires_grad=weight.requires_grad)
            handler(module, config)
            quantized = module.weight
            module.weight = None
            if adapter.is_traceable_wrapper_subclass(quantized):
                quantized = _kept(quantized, weights.convert_dir.folder)
            else:  # torchao left it as it was (Int4WeightOnlyConfig: a shape the group size does not divide)
                quantized = None
        module.weight = weight if quantized is None else torch.nn.Parameter(quantized, requires_grad=False)


def _kept(quantized: Any, folder: str) -> Any:
    """``quantized`` with each CPU inner tensor moved to a nameless file in ``folder``."""
    names, meta = quantized.__tensor_flatten__()
    inner = {}
    for name in names:
        tensor = getattr(quantized, name)
        cpu = not adapter.is_traceable_wrapper_subclass(tensor) and tensor.device.type == "cpu"
        inner[name] = mapped_copy(tensor, folder) if cpu and tensor.untyped_storage().nbytes() else tensor
    return type(quantized).__tensor_unflatten__(inner, meta, quantized.shape, quantized.stride())


_walking = threading.local()  # .active: this thread is inside a streaming walk (torchao's recursion)


def streaming_walk(real: Callable[..., Any]) -> Callable[..., Any]:
    """torchao's ``_replace_with_custom_fn_if_matches_filter`` (the walk every
    ``quantize_`` makes with a config, however ``quantize_`` was imported) that
    streams storage-less weights from the checkpoint (see the module docstring).
    Its own recursion, and every call without storage-less targets, runs as upstream's."""

    @functools.wraps(real)
    def _replace_with_custom_fn_if_matches_filter(model, replacement_fn, filter_fn, cur_fqn="", device=None,
                                                  extra_args=()):
        config = extra_args[0] if extra_args else None
        if getattr(_walking, "active", False) or cur_fqn or config is None:
            return real(model, replacement_fn, filter_fn, cur_fqn, device, extra_args)
        targets = _targets(model, filter_fn)
        if not targets:
            return real(model, replacement_fn, filter_fn, cur_fqn, device, extra_args)
        contexts = open_contexts()
        names = sorted({_describe(f"{fqn}.weight" if fqn else "weight", w) for fqn, _, w in targets})
        where = f"torchao quantize_ ({type(config).__name__})"
        if not contexts:
            raise QuantizationNeedsValuesError(names, where)
        reason = uncovered_reason(config)
        if reason is not None:
            raise QuantizationNeedsValuesError(names, where, reason)
        _record_tied(model, contexts)
        plan = _Plan(config, targets, contexts)
        done: list[str] = []

        def streaming_filter(module, fqn):
            if any(_under(fqn, d) for d in done):
                return False  # inside a module quantized here: torchao would not descend into it
            entry = plan.entries.get(id(module))
            if entry is not None and entry[0] == fqn:
                _quantize_one(module, fqn, entry[1], entry[2], entry[3], config, device)
                done.append(fqn)
                return False
            return filter_fn(module, fqn)

        _walking.active = True
        try:  # device: where each streamed weight is quantized; the storage-less model is not moved
            return real(model, replacement_fn, streaming_filter, cur_fqn, None, extra_args)
        finally:
            _walking.active = False

    return _replace_with_custom_fn_if_matches_filter


@contextlib.contextmanager
def streaming_quantization() -> Iterator[None]:
    """While active, torchao's ``quantize_`` streams storage-less weights from the
    checkpoint in threads with an open context and refuses them by name elsewhere
    (:func:`streaming_walk`; every thread: it changes only calls that
    upstream's code cannot run). Does nothing when torchao is not importable."""
    try:
        api = adapter.torchao_quant_api()
    except ImportError:
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(shadowed(api, "_replace_with_custom_fn_if_matches_filter",
                                     streaming_walk(api._replace_with_custom_fn_if_matches_filter)))
        global _HQQ_BANDS
        try:
            stack.enter_context(routing_hqq())
            _HQQ_BANDS = True
        except (ImportError, AttributeError, KeyError):  # another torchao: such weights are quantized whole
            _HQQ_BANDS = False
        if hasattr(api, "_fqn_to_config_handler"):
            stack.enter_context(shadowed(api, "_fqn_to_config_handler",
                                         refusing_storage_less(api._fqn_to_config_handler)))
        yield


def refusing_storage_less(real: Callable[..., Any]) -> Callable[..., Any]:
    """torchao's ``_fqn_to_config_handler`` (what ``quantize_`` applies to each module
    a ``FqnToConfig`` picks, without the walk) refusing a module with storage-less
    parameters by name, before anything is read; any other module runs as upstream's.

    Raises:
        QuantizationNeedsValuesError: the module's storage-less parameters, with
            the reason (``FqnToConfig`` is not covered: one ``quantize_`` call per
            config, with a ``filter_fn``, is).
    """

    @functools.wraps(real)
    def _fqn_to_config_handler(module, fqn, config, *args, **kwargs):
        names = sorted(_describe(f"{fqn}.{name}" if fqn else name, p)
                       for name, p in module.named_parameters() if is_storage_less(p))
        if names:
            raise QuantizationNeedsValuesError(
                names, "torchao quantize_ (FqnToConfig)",
                "FqnToConfig is not covered (call quantize_ once per config, with a filter_fn)")
        return real(module, fqn, config, *args, **kwargs)

    return _fqn_to_config_handler
