"""Hugging Face models without loading the weights: storage-less from ``config.json``, bound to the folder's shards.

Two ways in:

* :func:`model_from_config`: ``transformers.AutoModel*.from_config`` of a
  folder's ``config.json``, built by :func:`~ptdstream.weightless.storage_less_model`
  (storage-less parameters, real buffers); export it inside
  :func:`ptdstream.weights_from` on the same folder.
* :func:`pretrained_without_weights`: inside, every ``from_pretrained`` of a
  local folder (optimum-executorch's task loaders call it) builds the model as
  transformers does (``config.json``, dtype, attention implementation,
  generation config, tied weights) but reads no weight: the one step that reads
  them (``PreTrainedModel._load_pretrained_model``) is replaced, the model's
  meta parameters become storage-less cpu tensors and each one is recorded with
  its checkpoint key as transformers reads the folder
  (:mod:`ptdstream.weightless.hf_keys`: transformers' own renaming and fusing,
  run on stand-ins; a fused tensor's key is derived from the checkpoint's
  pieces, copied piece by piece when bound) on a :func:`ptdstream.weights_from`
  context opened on the folder at the first load and kept until exit
  (``WeightsFrom.record``). An exported program is bound when it reaches
  lowering (:mod:`ptdstream.weightless.lowering`: ``to_edge`` and
  ``to_edge_transform_and_lower`` begin with its ``run_decompositions``),
  each recorded tensor by its key whatever its FQN (so ``model.model.layers.0...``
  FQNs find ``model.layers.0...`` keys; nothing read); tied weights are one
  tensor, bound once. Until then the program stays storage-less, so optimum's
  second ``torch.export`` of ``program.module()`` (after ``RemoveRedundantTransposes``)
  traces storage-less tensors too (dynamo would clone real ones). Whatever
  runs from the lowering on (``constant_prop_pass``, XNNPACK's preprocess, the
  emitter, the save) sees the checkpoint's mapped tensors.

Refused by name, before anything is written: a checkpoint that is not
safetensors (``.bin`` files are pickles), a ``state_dict`` passed in, a
transformers quantizer, a device map beyond the CPU, a model's weight
transformers cannot load from the folder (no key becomes it, its shape does not
fit, a fusion fails: :class:`~ptdstream.weightless.BindingError` names each), a
shard the index names that is missing, unreadable or outside the folder
(:class:`~ptdstream.CheckpointFileError`), a checkpoint dtype other than the
export's that is not converted (float32, float16 and bfloat16 are, to one
another, as ``from_pretrained`` converts them), a ``.to()`` that would move or
convert a module with storage-less parameters, and a quantization config
weights_from does not cover (optimum's ``qlinear`` / ``qembedding`` 8da4w,
8da8w, 4w, 8w are: each weight is read from its shard and quantized as it
streams, :mod:`ptdstream.weightless.quantization`). Checkpoint keys the model
does not use are ignored, as ``from_pretrained`` ignores them. Unlike ``from_pretrained``,
nothing is initialized: a model without a checkpoint key has no value.

Patches (through :mod:`ptdstream.upstream.patching`, restored by the last exit):
``PreTrainedModel._load_pretrained_model`` (registered in
:mod:`ptdstream.upstream.names`, checked against transformers 5.0.0rc1),
``torch.nn.Module.to`` and those of :mod:`ptdstream.weightless.lowering`. They act only in the thread that
entered the context (elsewhere the originals run), except ``to``, which acts on
every module holding storage-less tensors (a no-op to the CPU in their dtypes,
refused otherwise; upstream's fails on them).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..upstream import adapter
from ..upstream.patching import shadowed
from .context import WeightsFrom, weights_from
from .errors import NeedsWeightValuesError
from .hf_keys import record_keys
from .lowering import binding_at_lowering
from .storage_less import is_storage_less, storage_less_model

__all__ = ["StorageLessPretrained", "model_from_config", "pretrained_without_weights"]

_local = threading.local()  # .active: the StorageLessPretrained contexts of this thread, innermost last

def model_from_config(folder: str | os.PathLike[str], auto_class: str = "AutoModelForCausalLM",
                      **from_config: Any) -> Any:
    """``transformers.<auto_class>.from_config(<folder>/config.json, **from_config)``
    with storage-less parameters and real buffers (rotary ``inv_freq`` computed).

    Example::

        with ptdstream.weights_from("my-llama/") as weights:
            model = model_from_config("my-llama/")
            program = weights.bind(torch.export.export(model, (tokens,)))

    Inside a :func:`ptdstream.weights_from` block on the same folder, each
    parameter is recorded with its checkpoint key as transformers reads the
    folder (:func:`~ptdstream.weightless.hf_keys.record_keys`: renamed and fused
    keys), so a program is bound whatever module wraps the model; elsewhere the
    model's ``state_dict`` names are the checkpoint's (``save_pretrained``'s).

    Raises:
        AttributeError: ``auto_class`` is not a transformers class.
        OSError: no readable ``config.json`` in ``folder``.
        BindingError: inside such a block, a weight transformers could not load
            from the folder (every one at once, by name).
    """
    import transformers

    from .lowering import open_contexts

    config = transformers.AutoConfig.from_pretrained(os.fspath(folder))
    cls = getattr(transformers, auto_class)
    model = storage_less_model(lambda: cls.from_config(config, **from_config))
    where = os.path.abspath(folder)
    for weights in reversed(open_contexts()):
        path = os.path.abspath(weights.checkpoint.path)
        if where in (path, os.path.dirname(path)):  # the folder's own context: its keys as transformers reads them
            record_keys(model, weights, adapter.model_conversion_mapping(model))
            break
    return model


class StorageLessPretrained:
    """What :func:`pretrained_without_weights` yields: ``weights`` ({folder:
    :class:`~ptdstream.weightless.WeightsFrom`}, one per folder loaded) and
    ``bound`` (how many exported programs were bound). Valid inside its block."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.weights: dict[str, WeightsFrom] = {}
        self._stack = stack

    @property
    def bound(self) -> int:
        """Exported programs bound so far (at lowering)."""
        return sum(w.programs_bound for w in self.weights.values())

    def _weights_for(self, name: Any, files: list[str]) -> tuple[str, WeightsFrom]:
        """The context of the folder ``from_pretrained(name)`` resolved ``files`` in,
        opened on first use: its index checked first (a missing, unreadable or
        outside shard is refused by name, :class:`~ptdstream.CheckpointFileError`)."""
        bad = [f for f in files if not f.endswith(".safetensors")]
        if bad:
            raise NeedsWeightValuesError(
                f"from_pretrained: weightless export reads safetensors shards; got {', '.join(bad)} (.bin files "
                "are pickles, not read): save the model with save_pretrained(safe_serialization=True)")
        given = os.fspath(name) if isinstance(name, (str, os.PathLike)) else ""
        folders = {os.path.dirname(os.path.abspath(f)) for f in files}
        folder = os.path.abspath(given) if given and os.path.isdir(given) else sorted(folders)[0]
        if folder not in self.weights:
            weights = self._stack.enter_context(weights_from(folder, allow_extra=True))
            weights.by_name = False  # binds the tensors load() recorded, by their keys
            self.weights[folder] = weights
        outside = sorted(f for f in files if os.path.dirname(os.path.abspath(f)) != folder)
        if outside:
            raise NeedsWeightValuesError(f"from_pretrained({given!r}): weightless export reads the safetensors "
                                         f"shards of one folder ({folder}); got {', '.join(outside)} too")
        return folder, self.weights[folder]

    def load(self, model: Any, arguments: dict[str, Any]) -> tuple:
        """Stand-in for ``_load_pretrained_model``: storage-less parameters, origins recorded, weights tied."""
        name = arguments.get("pretrained_model_name_or_path")
        refused = [what for what, bad in (
            ("a state_dict passed to from_pretrained", arguments.get("state_dict") is not None),
            ("a transformers quantizer (quantization_config)", arguments.get("hf_quantizer") is not None),
            ("a device mesh (tensor parallel)", arguments.get("device_mesh") is not None),
            ("a device map beyond the CPU", any(str(d) not in ("cpu", "meta") for d in
                                               (arguments.get("device_map") or {}).values())),
            ("no checkpoint files", not arguments.get("checkpoint_files")),
        ) if bad]
        if refused:
            raise NeedsWeightValuesError(f"from_pretrained({name!r}): weightless export cannot take "
                                         f"{'; '.join(refused)}: export without weightless")
        _, weights = self._weights_for(name, list(arguments["checkpoint_files"]))
        missing = record_keys(model, weights, arguments.get("weight_mapping"), arguments.get("dtype"))
        return model, missing, set(), set(), None, []


def _active() -> StorageLessPretrained | None:
    stack = getattr(_local, "active", None)
    return stack[-1] if stack else None


def _loading(real: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(real)

    @functools.wraps(real)
    def _load_pretrained_model(*args: Any, **kwargs: Any) -> Any:
        context = _active()
        if context is None:
            return real(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return context.load(bound.arguments["model"], dict(bound.arguments))

    return _load_pretrained_model


def _moving(real: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real)
    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        tensors = [*self.parameters(), *self.buffers()]
        if not any(is_storage_less(t) for t in tensors):
            return real(self, *args, **kwargs)
        for dtype in dict.fromkeys(t.dtype for t in tensors if t.is_floating_point()) or [torch.float32]:
            probe = torch.empty(0, dtype=dtype).to(*args, **kwargs)
            if probe.device.type != "cpu" or probe.dtype != dtype:
                raise NeedsWeightValuesError(
                    f"{type(self).__name__}.to({probe.device}, {probe.dtype}): a module with storage-less "
                    f"parameters ({dtype}, cpu) cannot be moved or converted (its weights are not loaded): export "
                    "on the CPU in the checkpoint's dtype, or export without weightless")
        if any(t.device.type != "cpu" for t in tensors):
            return real(self, *args, **kwargs)
        return self  # storage-less parameters are cpu tensors already: nothing to move

    return to


@contextlib.contextmanager
def pretrained_without_weights() -> Iterator[StorageLessPretrained]:
    """Inside, ``from_pretrained`` of a local safetensors folder loads no weight
    and every exported program is bound to the folder's shards as it reaches
    lowering (its ``run_decompositions``; see the module docstring).

    Example::

        with pretrained_without_weights():
            main_export("my-llama/", task="text-generation", recipe="xnnpack", output_dir="out/")

    Host memory: the models' buffers and graphs; weights are read in pieces
    from the mapped shards by the stages that need bytes. Contexts nest (the
    innermost one of a thread records) and run in several threads at once.

    Raises:
        NeedsWeightValuesError: see the module docstring, by name.
        BindingError: a model's weight the folder does not hold, or of another dtype or shape.
        ImportError: transformers is not installed.
    """
    import torch

    model_class: Any = adapter.pretrained_model_class()
    with contextlib.ExitStack() as stack:
        context = StorageLessPretrained(stack)
        stack.enter_context(shadowed(model_class, "_load_pretrained_model",
                                     classmethod(_loading(model_class._load_pretrained_model.__func__))))
        stack.enter_context(shadowed(torch.nn.Module, "to", _moving(torch.nn.Module.to)))
        stack.enter_context(binding_at_lowering())
        _local.active = getattr(_local, "active", None) or []
        _local.active.append(context)
        try:
            yield context
        finally:
            _local.active.remove(context)
