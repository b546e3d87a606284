"""Export without holding the weights: storage-less parameters, bound to a checkpoint.

:func:`weights_from` (``ptdstream.weights_from``) is the entry point;
:mod:`ptdstream.weightless.context` tells the route and what it refuses.

* ``lowering``: the one ``with`` line: in a thread with an open context,
  ``torch.export`` first makes a module's meta parameters storage-less, and each
  program is bound as it reaches lowering (``run_decompositions``, where
  ``to_edge`` and ``to_edge_transform_and_lower`` begin) or emission, by the
  context that recorded its tensors' keys or else the innermost one.
* ``storage_less``: models whose parameters are cpu FakeTensors (from a factory,
  or a meta-device module), buffers real.
* ``binding``: each storage-less constant of the exported programs matched by
  FQN (or its recorded key) to a checkpoint tensor, tied names once, every
  missing, extra, dtype or shape problem at once (float32/float16/bfloat16 to
  one another planned as converted), idempotent (a bound constant counts as
  bound); ``convert``: such a tensor, or any DCP tensor, converted piece by
  piece into a file of the context's folder and mapped back.
* ``context``: the context manager; the emitter's constants by reference, the
  generated graph sources released with their code, and a checkpoint file
  changed since the context opened it refused (identities checked at
  conversion, emission and exit); ``emission``: ``emit_program`` refusing an
  unbound constant, or one quantized from storage-less weights, by name, and a
  changed checkpoint file before and after emitting.
* What an export computes from a weight, one weight at a time, written to a
  nameless temp file and bound like a checkpoint tensor: ``folding``
  (``constant_prop_pass`` on bound programs; ``mapped_copy``, and a large
  transpose written in bands), ``quantization`` (torchao's ``quantize_``: each
  weight read from the checkpoint and quantized by torchao's own handler, its
  quantized tensors in files, a large one in bands of rows;
  ``quantized_storages``: each quantized tensor's storage to its checkpoint
  key, so that ``unwrap_tensor_subclass``'s plain constants are bound to it).
* ``delegates``: XNNPACK's constants by reference and its per-partition copy
  sharing the bound tensors.
* ``to_device`` / ``device_load``: inside the context, executorch's
  ``CudaBackend`` loads each bound constant straight from the checkpoint file to
  the GPU through the pinned ring, once, shared by later methods.
* ``hf``: Hugging Face folders without loading them (``model_from_config``;
  ``pretrained_without_weights``, under which ``from_pretrained`` reads no weight
  and each program is bound as it reaches lowering).
* ``errors``: every error of the route, each by name.
"""

from .context import WeightsFrom, weights_from
from .errors import (
    BindingError,
    MetaBufferError,
    NeedsWeightValuesError,
    QuantizationNeedsValuesError,
    QuantizationShapeError,
    UnboundConstantError,
)
from .hf import model_from_config, pretrained_without_weights
from .storage_less import is_storage_less, storage_less_model

__all__ = ["BindingError", "MetaBufferError", "NeedsWeightValuesError", "QuantizationNeedsValuesError",
           "QuantizationShapeError", "UnboundConstantError", "WeightsFrom", "is_storage_less", "model_from_config",
           "pretrained_without_weights", "storage_less_model", "weights_from"]
