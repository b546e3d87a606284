"""Export without holding the weights: storage-less parameters, bound to a checkpoint.

:func:`weights_from` (``ptdstream.weights_from``) is the entry point; see
:mod:`ptdstream.weightless.context` for the route and what it refuses.
"""

from .binding import BindingError, UnboundConstantError
from .context import WeightsFrom, weights_from
from .quantization import QuantizationNeedsValuesError
from .storage_less import MetaBufferError, is_storage_less, storage_less_model

__all__ = ["BindingError", "MetaBufferError", "QuantizationNeedsValuesError", "UnboundConstantError", "WeightsFrom",
           "is_storage_less", "storage_less_model", "weights_from"]
