"""The built-in example (``ptdstream demo``): a small tied-embedding LM
(``model``), exported, saved with ptdstream, verified and run (``run``). Not part
of the library's core: nothing else in ptdstream imports it."""

import argparse
import os

__all__ = ["DATA_TAG", "METHODS", "add_arguments", "check_folders", "model"]

#: The data file's tag: every weight goes to ``<out>/model.ptd``.
DATA_TAG = "model"
#: The exported methods: (name, tokens per call).
METHODS: tuple[tuple[str, int], ...] = (("forward", 8), ("prefill", 16))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the demo's options (``--out``, ``--reference``, ``--no-run``) to ``parser``; returns it."""
    parser.add_argument(
        "-o", "--out", "--output", dest="out", default="./ptdstream-demo",
        help="scratch folder for model.pte and model.ptd, replaced there on every run "
             "(default: %(default)s)",
    )
    parser.add_argument(
        "--reference", metavar="DIR", default=None,
        help="also write executorch's own files (its serializer: manager.write_to_file and "
             "write_tensor_data_to_file) as DIR/model.pte and DIR/model.ptd, replaced there on every run: "
             "the ref/ of `ptdstream verify OUT/model.pte --against DIR/model.pte`",
    )
    parser.add_argument(
        "--no-run", action="store_true",
        help="skip loading the files with the ExecuTorch runtime",
    )
    return parser


def check_folders(args: argparse.Namespace) -> str | None:
    """Create ``args.out`` (and ``args.reference``, if given) with their parents before
    minutes of export; the one-line reason they cannot be used, or None.

    Refused: a path that exists and is not a folder, a folder that cannot be created or
    written, a reference folder that is the output folder (upstream's files would
    replace ptdstream's).
    """
    folders = [("--out", args.out)]
    if getattr(args, "reference", None) is not None:
        if os.path.realpath(args.reference) == os.path.realpath(args.out):
            return (f"ptdstream demo: --reference {args.reference} is the output folder; give another folder "
                    "(executorch's files would replace ptdstream's)")
        folders.append(("--reference", args.reference))
    for option, folder in folders:  # every refusal that needs no folder made comes first
        if os.path.exists(folder) and not os.path.isdir(folder):
            return f"ptdstream demo: {option} {folder} exists and is not a folder"
    for option, folder in folders:
        try:
            os.makedirs(folder, exist_ok=True)
            if not os.access(folder, os.W_OK):
                raise PermissionError(13, "folder is not writable", folder)
        except (FileExistsError, NotADirectoryError):
            return f"ptdstream demo: {option} {folder} exists and is not a folder"
        except OSError as e:
            return f"ptdstream demo: cannot create the folder {folder} ({option}): {e.strerror}"
    return None
