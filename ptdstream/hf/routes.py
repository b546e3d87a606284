"""The export of a Hugging Face folder, loaded or weightless: :func:`export`.

The loaded route is optimum-executorch's ``main_export`` with ptdstream saving
(:func:`ptdstream.hf.saving.run_main_export`); the weightless one runs it under
:func:`ptdstream.weightless.hf.pretrained_without_weights`, after refusing every
option that needs the weights' values (:func:`refuse_quantization`, one list for
the API and the command line).
"""

from __future__ import annotations

__all__ = ["QUANTIZE_OPTIONS", "export", "quantization_refusal", "refuse_quantization"]

#: optimum's task options that quantize the eager model (torchao: needs the weights' values),
#: refused with ``weightless`` before anything is imported (:func:`quantization_refusal`).
QUANTIZE_OPTIONS = ("qlinear", "qlinear_encoder", "qembedding", "qembedding_encoder")


def export(model_dir: str, output_dir: str, task: str = "text-generation", recipe: str = "xnnpack", *,
           by_reference: bool = True, weightless: bool = False, **options) -> dict[str, object]:
    """``optimum.exporters.executorch.main_export`` with ptdstream saving
    (:func:`ptdstream.hf.saving.run_main_export`: arguments, return value).

    ``weightless``: load no weight (see :mod:`ptdstream.hf`); ``model_dir``
    must hold safetensors shards whose keys, dtypes and shapes are the model's.
    ``progress=True``: each stage printed on stderr as it begins and ends, with
    its seconds (load, ``torch.export`` of each method, lowering, save).

    Raises:
        NeedsWeightValuesError: with ``weightless``, an option that needs the
            weights' values (``qlinear``, ``qembedding``, ...), before anything
            runs; a non-safetensors folder; a ``dtype``/device move of the model.
        BindingError: with ``weightless``, every weight the folder lacks or holds
            in another dtype or shape, by name; nothing written.
        ImportError: optimum-executorch is not installed (``ptdstream[hf]``).
    """
    from .saving import run_main_export

    if not weightless:
        return run_main_export(model_dir, output_dir, task, recipe, by_reference=by_reference, **options)
    from ..weightless.hf import pretrained_without_weights

    refuse_quantization(model_dir, options, "{}={!r}", "weightless=True", "export with weightless=False")
    with pretrained_without_weights():
        return run_main_export(model_dir, output_dir, task, recipe, by_reference=by_reference, **options)


def quantization_refusal(where: str, options: dict, spelling: str, flag: str, instead: str) -> str | None:
    """The message refusing every option of :data:`QUANTIZE_OPTIONS` given a value in
    ``options`` (``spelling.format(name, value)`` names each), for API and CLI alike;
    None when none is. Imports nothing: the command line answers before torch loads."""
    asked = [spelling.format(k, options[k]) for k in QUANTIZE_OPTIONS if options.get(k)]
    if not asked:
        return None
    return (f"{where}: {', '.join(asked)}: quantization (torchao) needs the weights' values, which "
            f"{flag} does not load; drop the option, or {instead}")


def refuse_quantization(where: str, options: dict, spelling: str, flag: str, instead: str) -> None:
    """Raise :func:`quantization_refusal`'s message, if any.

    Raises:
        NeedsWeightValuesError: naming each such option and its value.
    """
    message = quantization_refusal(where, options, spelling, flag, instead)
    if message is not None:
        from ..weightless.errors import NeedsWeightValuesError

        raise NeedsWeightValuesError(message)
