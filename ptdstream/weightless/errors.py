"""The errors of the weightless route (:func:`ptdstream.weights_from`, the Hugging Face
folders it reads): each names the weights, keys or options involved, and nothing
was written when one is raised. Reachable from the package root (``ptdstream.BindingError``)."""

from __future__ import annotations

from ..errors import CheckpointMismatchError, PtdstreamError

__all__ = ["BindingError", "MetaBufferError", "NeedsWeightValuesError", "QuantizationNeedsValuesError",
           "QuantizationShapeError", "UnboundConstantError"]

#: What to do, in a :class:`QuantizationNeedsValuesError` message of weights no context can read.
QUANTIZATION_ADVICE = ("quantization needs the weights' values: call torchao's quantize_ inside the weights_from "
                       "block, in its thread (each weight is read from the checkpoint and quantized there), or "
                       "export this model with real weights")
#: What to do, in a :class:`QuantizationNeedsValuesError` message of a config weights_from does not cover.
UNCOVERED_ADVICE = ("weights_from quantizes storage-less weights as they stream with Int8DynamicActivationIntx"
                    "WeightConfig and IntxWeightOnlyConfig (int4 or int8, PerGroup or PerAxis(0), symmetric, "
                    "unpacked_to_int8, affine or hqq_scale_only) and Int4WeightOnlyConfig (tile_packed_to_4d): "
                    "use one of them, or export this model with real weights (outside weights_from)")


class MetaBufferError(PtdstreamError, ValueError):
    """A non-persistent buffer is on the meta device: it is not in any checkpoint,
    so it has no value to export. Compute it in the factory (build with
    :func:`storage_less_model` from a factory) or assign a real tensor."""


class BindingError(CheckpointMismatchError):
    """The checkpoint does not fit the exported programs' storage-less constants.

    ``problems`` lists every one, each naming the FQN, the checkpoint key and
    file, and both dtypes or shapes. Nothing was bound.
    """

    def __init__(self, checkpoint: str, problems: list[str]) -> None:
        super().__init__("the exported program's storage-less constants (nothing bound)", checkpoint, problems)
        self.args = (self.args[0] + "\n" + _advice(self.problems),)


def _advice(problems: list[str]) -> str:
    """What to do: a map fixes names (a missing or extra key), never a dtype or a shape."""
    if any(p.startswith(("missing:", "extra:")) for p in problems):
        return "fix the checkpoint, or map names with key_map={fqn: checkpoint key}"
    return ("fix the checkpoint: it holds these weights in other dtypes or shapes than the model (a checkpoint of "
            "another configuration?); a key_map cannot change a dtype or a shape")


class UnboundConstantError(PtdstreamError, ValueError):
    """A constant that holds no bytes reached emission or a save outside every
    ``weights_from`` block that could bind it (a program lowered or emitted after
    its block), or came after binding (a constant a pass made from storage-less
    values). ``names`` lists them."""

    def __init__(self, names: list[str], where: str) -> None:
        self.names = list(names)
        super().__init__(
            f"{where}: {len(names)} constant(s) hold no bytes (storage-less, never bound to a checkpoint "
            f"tensor): {', '.join(names)}; export, lower and emit inside the weights_from block, where each "
            "program is bound as it reaches lowering (or by weights.bind(exported_program)); a program lowered "
            "or emitted after the block stays unbound, as does a constant a pass made from storage-less values")


class QuantizationNeedsValuesError(PtdstreamError, ValueError):
    """A quantization of storage-less weights that cannot be computed: outside a
    ``weights_from`` block (or its thread), or with a config it does not cover
    (``reason`` says which field). ``names`` lists the weights; nothing was read."""

    def __init__(self, names: list[str], where: str, reason: str | None = None) -> None:
        self.names = list(names)
        self.reason = reason
        super().__init__(f"{where}: {len(names)} storage-less weight(s) would be quantized: {', '.join(names)}; "
                         + (f"{reason}: {UNCOVERED_ADVICE}" if reason else QUANTIZATION_ADVICE))


class QuantizationShapeError(PtdstreamError, ValueError):
    """Weights a config cannot quantize: a group size that does not divide the last
    dimension (torchao's ``choose_qparams_affine`` would fail on it with a bare
    ``AssertionError``). ``problems`` names each weight, its checkpoint key and
    file, and the sizes; raised before any of the call's weights is read, the
    model unchanged."""

    def __init__(self, where: str, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"{where}: {len(problems)} weight(s) cannot be quantized with this config (nothing read):\n"
                         + "\n".join(f"  {p}" for p in problems)
                         + "\nchoose a group size that divides them, or leave them out with filter_fn")


class NeedsWeightValuesError(PtdstreamError, ValueError):
    """A step of a weightless export needs the weights' values (quantization,
    moving or converting the model, loading a pickle): named, nothing written."""
