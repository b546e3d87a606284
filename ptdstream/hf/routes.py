"""The export of a Hugging Face folder, loaded or weightless: :func:`export`.

The loaded route is optimum-executorch's ``main_export`` with ptdstream saving
(:func:`ptdstream.hf.saving.run_main_export`); the weightless one runs it under
:func:`ptdstream.weightless.hf.pretrained_without_weights`, after refusing every
quantization option value it does not cover (:func:`refuse_quantization`, one list for
the API and the command line): optimum's quantization options are quantized as the
weights stream (:mod:`ptdstream.weightless.quantization`), save those values the
route does not cover.
"""

from __future__ import annotations

import os

__all__ = ["QUANTIZE_OPTIONS", "WEIGHTLESS_QUANTIZATION", "export", "quantization_refusal", "refuse_quantization",
           "safetensors_refusal"]

_LINEAR = ("8da4w", "8da8w", "4w", "8w")
#: optimum's task options that quantize the eager model (torchao), each with the values
#: (a comma-separated list: each entry) the weightless route quantizes as the weights stream
#: (:mod:`ptdstream.weightless.quantization`); any other value (``fpa4w``: MPS) is refused with
#: ``weightless`` before anything is imported (:func:`quantization_refusal`).
WEIGHTLESS_QUANTIZATION = {"qlinear": _LINEAR, "qlinear_encoder": _LINEAR, "qembedding": ("8w", "4w"),
                           "qembedding_encoder": ("8w", "4w"), "qlinear_packing_format": ("tile_packed_to_4d",),
                           "qlinear_encoder_packing_format": ("tile_packed_to_4d",)}
#: Those options' names.
QUANTIZE_OPTIONS = tuple(WEIGHTLESS_QUANTIZATION)


def export(model_dir: str, output_dir: str, task: str = "text-generation", recipe: str = "xnnpack", *,
           by_reference: bool = True, weightless: bool = False, **options) -> dict[str, object]:
    """``optimum.exporters.executorch.main_export`` with ptdstream saving
    (:func:`ptdstream.hf.saving.run_main_export`: arguments, return value).

    ``weightless``: load no weight (see :mod:`ptdstream.hf`); ``model_dir``
    must hold safetensors shards whose keys, dtypes and shapes are the model's.
    ``progress=True``: each stage printed on stderr as it begins and ends, with
    its seconds (load, ``torch.export`` of each method, lowering, save).

    With ``weightless``, ``qlinear``/``qembedding`` (8da4w, 8da8w, 4w, 8w / 8w, 4w)
    quantize each weight as it is read from the folder (the same bytes as the
    loaded export).

    Raises:
        NeedsWeightValuesError: with ``weightless``, a quantization option value
            it does not cover (:data:`WEIGHTLESS_QUANTIZATION`: ``qlinear='fpa4w'``),
            before anything runs; a non-safetensors folder; a ``dtype``/device move of the model.
        BindingError: with ``weightless``, every weight the folder lacks or holds
            in another dtype or shape, by name; nothing written.
        ImportError: optimum-executorch is not installed (``ptdstream[hf]``).
    """
    from .saving import run_main_export

    if not weightless:
        return run_main_export(model_dir, output_dir, task, recipe, by_reference=by_reference, **options)
    from ..weightless.hf import pretrained_without_weights

    refuse_quantization(model_dir, options, "{}={!r}", "weightless=True", "export with weightless=False")
    refusal = safetensors_refusal(model_dir, "weightless=True", "export with weightless=False")
    if refusal is not None:
        from ..weightless.errors import NeedsWeightValuesError

        raise NeedsWeightValuesError(refusal)
    with pretrained_without_weights():
        return run_main_export(model_dir, output_dir, task, recipe, by_reference=by_reference, **options)


def quantization_refusal(where: str, options: dict, spelling: str, flag: str, instead: str) -> str | None:
    """The message refusing every option of :data:`QUANTIZE_OPTIONS` given a value in
    ``options`` that :data:`WEIGHTLESS_QUANTIZATION` does not list (each entry of a
    comma-separated value; ``spelling.format(name, value)`` names each), for API and
    CLI alike; None when none is. Imports nothing: the command line answers before torch loads."""
    asked = [spelling.format(k, options[k]) for k, covered in WEIGHTLESS_QUANTIZATION.items() if options.get(k)
             and any(v.strip() not in covered for v in str(options[k]).split(","))]
    if not asked:
        return None
    listed = "; ".join(f"{k} {', '.join(v)}" for k, v in WEIGHTLESS_QUANTIZATION.items() if not k.endswith("format"))
    return (f"{where}: {', '.join(asked)}: {flag} quantizes each weight as it is read only with {listed}; "
            f"use one of them, or {instead}")


def refuse_quantization(where: str, options: dict, spelling: str, flag: str, instead: str) -> None:
    """Raise :func:`quantization_refusal`'s message, if any.

    Raises:
        NeedsWeightValuesError: naming each such option and its value.
    """
    message = quantization_refusal(where, options, spelling, flag, instead)
    if message is not None:
        from ..weightless.errors import NeedsWeightValuesError

        raise NeedsWeightValuesError(message)


def safetensors_refusal(model_dir: str, flag: str, instead: str) -> str | None:
    """The message refusing a local folder ``model_dir`` that holds no safetensors
    checkpoint (no ``*.safetensors``, no ``model.safetensors.index.json``: a
    ``pytorch_model.bin`` folder, whose pickles the weightless route never reads),
    naming what it holds instead; None otherwise (not a folder: optimum reports it).
    Imports nothing: the command line answers before torch loads."""
    if not os.path.isdir(model_dir):
        return None
    with os.scandir(model_dir) as entries:
        names = sorted(e.name for e in entries)
    if any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
        return None
    weights = [n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt")) or n == "pytorch_model.bin.index.json"]
    held = f"it holds {', '.join(weights[:3])}{' and more' if len(weights) > 3 else ''} (pickles, not read)" \
        if weights else "it holds no weights file"
    return (f"{model_dir}: {flag} reads safetensors shards and the folder has none; {held}: save the model with "
            f"save_pretrained(safe_serialization=True), or {instead}")
