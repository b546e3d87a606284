"""``python -m ptdstream.hf``: the ``optimum-cli`` command line with ptdstream saving.

``python -m ptdstream.hf export executorch -m DIR --task text-generation
--recipe xnnpack -o OUT [--weightless] [-f]``. :func:`main` checks what needs no
torch first (``-m`` a local folder with ``config.json``, ``--recipe`` one of
optimum's, ``-o`` no file and no folder holding ``.pte``/``.ptd`` files without
``-f``, ``--weightless`` with no quantization option value it does not cover, ``--help``), before optimum,
torch or transformers is imported, then runs optimum-cli
(:func:`ptdstream.hf.saving.run_optimum_cli`), under
:func:`ptdstream.weightless.hf.pretrained_without_weights` for ``--weightless``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..errors import PtdstreamError
from .routes import QUANTIZE_OPTIONS, quantization_refusal, safetensors_refusal

__all__ = ["FORCE_FLAGS", "HELP", "HELP_WITHOUT_COMMAND", "OPTIMUM_RECIPES", "QUIET_FLAGS", "WEIGHTLESS_FLAG", "main",
           "usage_error"]

#: The command-line flag of :func:`main` (removed before optimum-cli parses the rest).
WEIGHTLESS_FLAG = "--weightless"
#: ptdstream's flag to replace the .pte/.ptd files of an earlier export in ``-o`` (removed too).
FORCE_FLAGS = ("-f", "--force")
#: ptdstream's flag to print nothing but errors: no stage lines, no report (removed too).
QUIET_FLAGS = ("-q", "--quiet")

#: optimum-executorch 1.1.0's recipe names (``recipe_registry`` after
#: ``discover_recipes()``, ``optimum/exporters/executorch/recipe_registry.py``),
#: listed here so that :func:`main` checks ``--recipe`` before importing optimum.
OPTIMUM_RECIPES = ("coreml_fp16", "coreml_fp16_cpu", "coreml_fp16_gpu", "coreml_fp16_ne", "coreml_fp32",
                   "coreml_fp32_cpu", "coreml_fp32_gpu", "coreml_fp32_ne", "cuda", "cuda-windows", "metal",
                   "portable", "xnnpack")

#: optimum-cli's integer options of ``export executorch`` (its parser's ``type=int``), each
#: with an example value: checked before optimum is imported.
INTEGER_OPTIONS = {"max_seq_len": 2048, "qlinear_group_size": 32, "qlinear_encoder_group_size": 32,
                   "qembedding_group_size": 32, "qembedding_encoder_group_size": 32}

#: What :func:`main` prints for ``--help`` without a command (optimum is not imported).
HELP_WITHOUT_COMMAND = """
The options of the export itself are optimum-cli's:
  python -m ptdstream.hf export executorch --help
"""

#: What :func:`main` prints before optimum-cli's own ``--help``.
HELP = f"""usage: python -m ptdstream.hf export executorch -m DIR --task TASK --recipe RECIPE -o OUT
           [--weightless] [-f] [-q]

optimum-cli with every .pte/.ptd saved by ptdstream's streaming writer (the same bytes as executorch's).
ptdstream's options and checks (made before optimum, torch or transformers is imported):
  {WEIGHTLESS_FLAG}          build the model from DIR/config.json with no weight loaded; each program
                        is bound to DIR's safetensors shards, which the save streams (the same
                        bytes as a loaded export; --qlinear 8da4w/8da8w/4w/8w and --qembedding
                        8w/4w quantize each weight as it is read); a DIR without safetensors
                        (pytorch_model.bin only) is refused
  -f, --force           replace the .pte/.ptd files of an earlier export in OUT; without it an
                        OUT that holds any .pte or .ptd file is refused (the export writes
                        model.pte and a .ptd per tag, named only once it has run)
  -q, --quiet           print nothing but errors; without it each stage (load, torch.export of
                        each method, lowering, save) is printed on stderr as it begins and ends,
                        with its seconds, then the files written
  -m/--model DIR        a local folder with config.json (nothing is downloaded)
  --task TASK           optimum's task; text-generation when left out (an LLM); a BERT, ViT or
                        Whisper folder needs its own (fill-mask, image-classification, ...)
  -o/--output_dir OUT   a folder (created if missing); not one holding .pte/.ptd files, without -f
  --recipe RECIPE       one of {", ".join(OPTIMUM_RECIPES)}
  --max_seq_len N, --qlinear_group_size N, ...
                        optimum's integer options: positive integers

optimum-cli's own help follows.
"""


def _given(args: Sequence[str]) -> dict[str, str | None]:
    """The values in ``args`` of the options ptdstream checks (``model``,
    ``output_dir``, ``recipe`` and :data:`QUANTIZE_OPTIONS`), read as optimum-cli's
    parser reads them (``-m DIR``, ``--model=DIR``, ``-oOUT``, abbreviations);
    ``{}`` for a line that parser would refuse (it reports that)."""
    options = _Lenient(add_help=False)
    options.add_argument("-m", "--model")
    options.add_argument("-o", "--output_dir")
    options.add_argument("--recipe")
    for name in INTEGER_OPTIONS:
        options.add_argument(f"--{name}")
    for name in QUANTIZE_OPTIONS:
        options.add_argument(f"--{name}")
    try:
        return vars(options.parse_known_args(list(args))[0])
    except ValueError:  # an ambiguous abbreviation, an option without its value
        return {}


class _Lenient(argparse.ArgumentParser):
    """A parser whose errors raise ``ValueError`` (nothing printed, no exit)."""

    def error(self, message: str):
        raise ValueError(message)


def usage_error(args: Sequence[str], force: bool = False) -> str | None:
    """The one-line error of an ``export executorch`` command line whose ``-m``
    is not a local model folder, whose ``--recipe`` is no optimum recipe, or whose
    ``-o`` is a file or (without ``force``) a folder holding ``.pte``/``.ptd``
    files; None when they are fine (optimum's parser checks the rest)."""
    if list(args[:2]) != ["export", "executorch"]:
        return None
    given = _given(args)
    if not given:  # optimum-cli's parser refuses the line: its message
        return None
    model = given.get("model")
    if model is None:
        return "-m/--model DIR is required: the local Hugging Face model folder (with config.json) to export"
    if not os.path.isdir(model):
        return (f"-m {model}: no such folder; give a local model folder (config.json and safetensors, as "
                "save_pretrained writes them): nothing is downloaded")
    if not os.path.isfile(os.path.join(model, "config.json")):
        return (f"-m {model}: no config.json in that folder; give the folder save_pretrained wrote "
                "(config.json and safetensors)")
    recipe = given.get("recipe")
    if recipe is not None and recipe not in OPTIMUM_RECIPES:
        return f"--recipe {recipe}: not an optimum-executorch recipe; use one of {', '.join(OPTIMUM_RECIPES)}"
    for name in INTEGER_OPTIONS:
        value = given.get(name)
        if value is not None and not _positive_integer(value):
            return f"--{name} {value}: not a positive integer (e.g. --{name} {INTEGER_OPTIONS[name]})"
    return _output_error(given.get("output_dir"), force)


def _positive_integer(value: str) -> bool:
    try:
        return int(value) > 0
    except ValueError:
        return False


def _output_error(out: str | None, force: bool) -> str | None:
    """Why ``-o OUT`` cannot be written as given, or None: a file, or a folder
    holding ``.pte``/``.ptd`` files (an earlier export's) without ``-f``."""
    if out is None or not os.path.exists(out):
        return None
    if not os.path.isdir(out):
        return f"-o {out}: a file, not a folder; give the folder for the .pte/.ptd files"
    if force:
        return None
    with os.scandir(out) as entries:
        held = sorted((e.name for e in entries if e.name.endswith((".pte", ".ptd"))),
                      key=lambda n: (n.endswith(".ptd"), n))  # the programs first
    if not held:
        return None
    shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    return (f"-o {out} holds {shown} (an earlier export?); use -f/--force to replace its .pte/.ptd files, "
            "or give another folder")


def main(argv: Sequence[str] | None = None) -> int:
    """``optimum-cli`` with ptdstream saving (:func:`ptdstream.hf.saving.run_optimum_cli`),
    plus ``--weightless``, ``-f``/``--force`` and ``-q``/``--quiet`` anywhere in ``argv``:
    without ``-q`` each stage of the export is printed on stderr as it begins and
    ends (:mod:`ptdstream.hf.stages`), then the files written.

    ``python -m ptdstream.hf export executorch -m DIR --task text-generation
    --recipe xnnpack -o OUT --weightless``. Before optimum (and torch) is imported:
    ``-h``/``--help`` prints :data:`HELP` (``--weightless``, ``-f``) before optimum-cli's help
    (alone, with :data:`HELP_WITHOUT_COMMAND`, when no command precedes it);
    an ``export executorch`` whose ``-m`` is no local folder with ``config.json``,
    whose ``--recipe`` is not in :data:`OPTIMUM_RECIPES`, or whose ``-o`` is a file
    or, without ``-f``, a folder holding any ``.pte``/``.ptd`` file (an earlier
    export: the names this one writes are known only once it has run) prints one
    line (``ptdstream.hf: error: ...``, naming it) and returns 2; with
    ``--weightless``, a quantization option value the weightless route does not cover
    (``--qlinear fpa4w``: :func:`ptdstream.hf.routes.quantization_refusal`) prints
    one line and returns 1.
    Returns 0; with ``--weightless``, a refusal during the export
    (:class:`~ptdstream.errors.PtdstreamError`: the message names the weight or
    option) is printed to stderr and returns 1, nothing written.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        if args[0] in ("-h", "--help"):  # optimum-cli's top level: only its command names
            print(HELP.removesuffix("optimum-cli's own help follows.\n") + HELP_WITHOUT_COMMAND.lstrip("\n"), end="")
            return 0
        print(HELP, flush=True)
    weightless = WEIGHTLESS_FLAG in args
    force = any(a in FORCE_FLAGS for a in args)
    quiet = any(a in QUIET_FLAGS for a in args)
    args = [a for a in args if a != WEIGHTLESS_FLAG and a not in FORCE_FLAGS + QUIET_FLAGS]
    if "-h" not in args and "--help" not in args:
        error = usage_error(args, force)
        if error is not None:
            print(f"ptdstream.hf: error: {error}", file=sys.stderr)
            return 2
        if weightless:  # before optimum and torch are imported (a minute on a busy machine)
            given = _given(args)
            refusal = quantization_refusal(given.get("model") or "ptdstream.hf", given, "--{} {!r}",
                                           WEIGHTLESS_FLAG, f"export without {WEIGHTLESS_FLAG}")
            model = given.get("model")
            if refusal is None and model:
                refusal = safetensors_refusal(model, WEIGHTLESS_FLAG, f"export without {WEIGHTLESS_FLAG}")
            if refusal is not None:
                print(f"ptdstream.hf: error: {refusal}", file=sys.stderr)
                return 1
    from .saving import run_optimum_cli

    if not weightless:
        return run_optimum_cli(args, progress=not quiet, quiet=quiet)
    from ..weightless.hf import pretrained_without_weights

    try:
        with pretrained_without_weights():
            return run_optimum_cli(args, progress=not quiet, quiet=quiet)
    except PtdstreamError as e:
        print(f"ptdstream.hf: error: {e}", file=sys.stderr)
        return 1
