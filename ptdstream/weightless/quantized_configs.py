"""Which torchao configs stream, and how their groups run along a weight.

The rules :mod:`ptdstream.weightless.quantization` applies before anything is
read: a config outside :data:`COVERED` is refused by name
(:func:`uncovered_reason`), a ``PerGroup`` size is checked against the
dimension torchao groups along (:func:`grouped_dim`), and a weight is banded
only under a config whose rows are quantized alone (:func:`row_local`).
Configs are recognized by their class and field names (torchao is not
imported here); each rule names the torchao function it mirrors.
"""

from __future__ import annotations

from typing import Any

__all__ = ["COVERED", "ROW_WISE", "group_size", "grouped_dim", "hqq_refuses", "named", "row_local", "uncovered_reason"]

#: The torchao configs quantized as the weights stream, with what each must hold (:func:`uncovered_reason`).
COVERED = (
    "Int8DynamicActivationIntxWeightConfig (optimum's 8da4w/8da8w, executorch's LLM exporter's 8da4w: weight_dtype "
    "int4 or int8, PerGroup or PerAxis(0), symmetric, unpacked_to_int8, affine or hqq_scale_only)",
    "IntxWeightOnlyConfig (optimum's 4w/8w and --qembedding: weight_dtype int4 or int8, PerGroup or PerAxis(0), "
    "symmetric, unpacked_to_int8, affine or hqq_scale_only)",
    "Int4WeightOnlyConfig (the CUDA backend's int4: tile_packed_to_4d, hqq or tinygemm)",
)

#: The configs whose scales are per row or per group of a row (banded past
#: :data:`~ptdstream.weightless.quantization.LARGE_NBYTES`).
ROW_WISE = ("Int8DynamicActivationIntxWeightConfig", "IntxWeightOnlyConfig")


def row_local(config: Any) -> bool:
    """Whether each quantized row of ``config`` depends on its own row only: a row-wise
    config under the ``affine`` algorithm. ``hqq_scale_only`` is not: torchao stops
    its iterations when the largest change of any scale in the whole tensor is
    small (``quant_primitives.py``, ``_choose_qparams_and_quantize_scale_only_hqq``,
    ``early_stop_tol``), so a band alone can stop at another iteration than the
    tensor (:mod:`ptdstream.weightless.hqq_bands` runs its iterations over the bands)."""
    return type(config).__name__ in ROW_WISE and named(config.intx_choose_qparams_algorithm, "affine")


def named(value: Any, *names: str) -> bool:
    """Whether an enum member (or its plain-string spelling) is one of ``names`` (lower case)."""
    spelled = {str(getattr(value, "value", value)).lower(), str(getattr(value, "name", value)).lower()}
    return bool(spelled & set(names))


def uncovered_reason(config: Any) -> str | None:
    """Why ``config`` is not quantized as the weights stream (one of :data:`COVERED`), or None."""
    name = type(config).__name__

    def granularity(g: Any) -> bool:
        kind = type(g).__name__
        return kind == "PerGroup" or (kind == "PerAxis" and getattr(g, "axis", None) == 0)

    if name in ROW_WISE:
        weight = name == "Int8DynamicActivationIntxWeightConfig"
        checks = {
            "weight_dtype": str(config.weight_dtype) in ("torch.int4", "torch.int8"),
            ("weight_granularity" if weight else "granularity"):
                granularity(config.weight_granularity if weight else config.granularity),
            ("weight_mapping_type" if weight else "mapping_type"):
                named(config.weight_mapping_type if weight else config.mapping_type, "symmetric"),
            ("weight_scale_dtype" if weight else "scale_dtype"):
                (config.weight_scale_dtype if weight else config.scale_dtype) is None,
            "intx_packing_format": named(config.intx_packing_format, "unpacked_to_int8"),
            "intx_choose_qparams_algorithm": named(config.intx_choose_qparams_algorithm, "affine",
                                                    "hqq_scale_only"),
            "version": config.version == 2,
        }
        if weight:
            checks["act_mapping_type"] = named(config.act_mapping_type, "asymmetric")
    elif name == "Int4WeightOnlyConfig":
        checks = {"int4_packing_format": named(config.int4_packing_format, "tile_packed_to_4d"),
                  "int4_choose_qparams_algorithm": named(config.int4_choose_qparams_algorithm, "hqq", "tinygemm"),
                  "version": config.version == 2}
    else:
        return f"{name} is not covered"
    bad = [f"{field}={getattr(config, field)!r}" for field, ok in checks.items() if not ok]
    return f"{name} with {', '.join(bad)} is not covered" if bad else None


def group_size(config: Any) -> int | None:
    """The group size a row-wise config quantizes with (PerGroup; None for PerAxis and
    other configs: ``Int4WeightOnlyConfig`` leaves a weight it does not divide as it
    is, ``_int4_weight_only_quantize_tensor``)."""
    name = type(config).__name__
    if name not in ROW_WISE:
        return None
    granularity = config.weight_granularity if name == "Int8DynamicActivationIntxWeightConfig" else config.granularity
    return getattr(granularity, "group_size", None) if type(granularity).__name__ == "PerGroup" else None


def hqq_refuses(config: Any, weight: Any) -> bool:
    """Whether torchao's HQQ scale-only refuses ``weight`` whatever its group size (it
    takes 2-D weights alone: ``quant_primitives._choose_qparams_and_quantize_scale_only_hqq``):
    then torchao's own error is the one to give, not a group size's."""
    return type(config).__name__ in ROW_WISE and weight.dim() != 2 and named(
        getattr(config, "intx_choose_qparams_algorithm", None), "hqq_scale_only")


def grouped_dim(config: Any, weight: Any) -> int:
    """The dimension a PerGroup config's groups run along: a 4-D (Conv2d) weight's input
    channels under ``IntxWeightOnlyConfig`` (block ``(1, group, 1, 1)``), else the last
    (torchao ``quant_api._intx_weight_only_quantize_tensor``)."""
    if type(config).__name__ == "IntxWeightOnlyConfig" and weight.dim() == 4:
        return 1
    return max(weight.dim() - 1, 0)
