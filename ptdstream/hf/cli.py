"""``python -m ptdstream.hf``: the ``optimum-cli`` command line with ptdstream saving.

``python -m ptdstream.hf export executorch -m DIR --task text-generation
--recipe xnnpack -o OUT [--weightless]``. :func:`main` checks what needs no
torch first (``-m`` a local folder with ``config.json``, ``--recipe`` one of
optimum's, ``--help``), then runs optimum-cli (:func:`ptdstream.hf.saving.run_optimum_cli`),
under :func:`ptdstream.weightless.hf.pretrained_without_weights` for ``--weightless``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..errors import PtdstreamError
from .routes import refuse_quantization

__all__ = ["HELP", "HELP_WITHOUT_COMMAND", "OPTIMUM_RECIPES", "WEIGHTLESS_FLAG", "main", "usage_error"]

#: The command-line flag of :func:`main` (removed before optimum-cli parses the rest).
WEIGHTLESS_FLAG = "--weightless"

#: optimum-executorch 1.1.0's recipe names (``recipe_registry`` after
#: ``discover_recipes()``, ``optimum/exporters/executorch/recipe_registry.py``),
#: listed here so that :func:`main` checks ``--recipe`` before importing optimum.
OPTIMUM_RECIPES = ("coreml_fp16", "coreml_fp16_cpu", "coreml_fp16_gpu", "coreml_fp16_ne", "coreml_fp32",
                   "coreml_fp32_cpu", "coreml_fp32_gpu", "coreml_fp32_ne", "cuda", "cuda-windows", "metal",
                   "portable", "xnnpack")

#: What :func:`main` prints for ``--help`` without a command (optimum is not imported).
HELP_WITHOUT_COMMAND = """
The options of the export itself are optimum-cli's:
  python -m ptdstream.hf export executorch --help
"""

#: What :func:`main` prints before optimum-cli's own ``--help``.
HELP = f"""usage: python -m ptdstream.hf export executorch -m DIR --task TASK --recipe RECIPE -o OUT [--weightless]

optimum-cli with every .pte/.ptd saved by ptdstream's streaming writer (the same bytes as executorch's).
ptdstream's options and checks (made before optimum loads):
  {WEIGHTLESS_FLAG}          build the model from DIR/config.json with no weight loaded; each program
                        is bound to DIR's safetensors shards, which the save streams (the same
                        bytes as a loaded export; quantization options are refused)
  -m/--model DIR        a local folder with config.json (nothing is downloaded)
  --recipe RECIPE       one of {", ".join(OPTIMUM_RECIPES)}

optimum-cli's own help follows.
"""


def _option(args: Sequence[str], *names: str) -> str | None:
    """The value of the last of ``names`` in ``args`` (``-m DIR`` or ``--model=DIR``), if given."""
    value = None
    for i, arg in enumerate(args):
        if arg in names and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--") and arg.split("=", 1)[0] in names and "=" in arg:
            value = arg.split("=", 1)[1]
    return value


def usage_error(args: Sequence[str]) -> str | None:
    """The one-line error of an ``export executorch`` command line whose ``-m``
    is not a local model folder or whose ``--recipe`` is no optimum recipe; None
    when they are fine (optimum's parser checks the rest)."""
    if list(args[:2]) != ["export", "executorch"]:
        return None
    model = _option(args, "-m", "--model")
    if model is None:
        return "-m/--model DIR is required: the local Hugging Face model folder (with config.json) to export"
    if not os.path.isdir(model):
        return (f"-m {model}: no such folder; give a local model folder (config.json and safetensors, as "
                "save_pretrained writes them): nothing is downloaded")
    if not os.path.isfile(os.path.join(model, "config.json")):
        return (f"-m {model}: no config.json in that folder; give the folder save_pretrained wrote "
                "(config.json and safetensors)")
    recipe = _option(args, "--recipe")
    if recipe is not None and recipe not in OPTIMUM_RECIPES:
        return f"--recipe {recipe}: not an optimum-executorch recipe; use one of {', '.join(OPTIMUM_RECIPES)}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``optimum-cli`` with ptdstream saving (:func:`ptdstream.hf.saving.run_optimum_cli`),
    plus ``--weightless`` anywhere in ``argv``.

    ``python -m ptdstream.hf export executorch -m DIR --task text-generation
    --recipe xnnpack -o OUT --weightless``. Before optimum (and torch) is imported:
    ``-h``/``--help`` prints :data:`HELP` (``--weightless``) before optimum-cli's help
    (alone, with :data:`HELP_WITHOUT_COMMAND`, when no command precedes it),
    and an ``export executorch`` whose ``-m`` is no local folder with ``config.json``
    or whose ``--recipe`` is not in :data:`OPTIMUM_RECIPES` prints one line
    (``ptdstream.hf: error: ...``, naming it) and returns 2. Returns 0; with ``--weightless``, a
    refusal (:class:`~ptdstream.errors.PtdstreamError`: the message names the
    weight or option) is printed to stderr and returns 1, nothing written:
    every option the API refuses (``--qlinear``, ``--qlinear_encoder``,
    ``--qembedding``, ``--qembedding_encoder``) is refused before optimum runs.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        if args[0] in ("-h", "--help"):  # optimum-cli's top level: only its command names
            print(HELP.removesuffix("optimum-cli's own help follows.\n") + HELP_WITHOUT_COMMAND.lstrip("\n"), end="")
            return 0
        print(HELP, flush=True)
    else:
        error = usage_error([a for a in args if a != WEIGHTLESS_FLAG])
        if error is not None:
            print(f"ptdstream.hf: error: {error}", file=sys.stderr)
            return 2
    from ..weightless.hf import QUANTIZE_OPTIONS, pretrained_without_weights
    from .saving import run_optimum_cli

    if WEIGHTLESS_FLAG not in args:
        return run_optimum_cli(args)

    options = argparse.ArgumentParser(add_help=False)  # optimum-cli's spelling of them, abbreviations too
    options.add_argument("-m", "--model", default="ptdstream.hf")
    for name in QUANTIZE_OPTIONS:
        options.add_argument(f"--{name}")
    given = vars(options.parse_known_args(args)[0])
    try:
        refuse_quantization(given["model"], given, "--{} {!r}", WEIGHTLESS_FLAG, f"export without {WEIGHTLESS_FLAG}")
        with pretrained_without_weights():
            return run_optimum_cli([a for a in args if a != WEIGHTLESS_FLAG])
    except PtdstreamError as e:
        print(f"ptdstream.hf: error: {e}", file=sys.stderr)
        return 1
