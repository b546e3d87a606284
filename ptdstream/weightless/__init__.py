"""Export without holding the weights: storage-less parameters, bound to a checkpoint.

:func:`weights_from` (``ptdstream.weights_from``) is the entry point; see
:mod:`ptdstream.weightless.context` for the route and what it refuses; :mod:`ptdstream.weightless.hf` for Hugging
Face folders (``from_pretrained`` and optimum-executorch without loading the weights).
"""

from .binding import BindingError, UnboundConstantError
from .context import WeightsFrom, weights_from
from .hf import NeedsWeightValuesError, model_from_config, pretrained_without_weights
from .quantization import QuantizationNeedsValuesError
from .storage_less import MetaBufferError, is_storage_less, storage_less_model

__all__ = ["BindingError", "MetaBufferError", "NeedsWeightValuesError", "QuantizationNeedsValuesError",
           "UnboundConstantError", "WeightsFrom", "is_storage_less", "model_from_config", "pretrained_without_weights",
           "storage_less_model", "weights_from"]
