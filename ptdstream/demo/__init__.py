"""The built-in example (``ptdstream demo``): a small tied-embedding LM
(``model``), exported, saved with ptdstream, verified and run (``run``). Not part
of the library's core: nothing else in ptdstream imports it."""

import argparse

__all__ = ["DATA_TAG", "METHODS", "add_arguments"]

#: The data file's tag: every weight goes to ``<out>/model.ptd``.
DATA_TAG = "model"
#: The exported methods: (name, tokens per call).
METHODS: tuple[tuple[str, int], ...] = (("forward", 8), ("prefill", 16))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the demo's options (``--out``, ``--no-run``) to ``parser``; returns it."""
    parser.add_argument(
        "-o", "--out", "--output", dest="out", default="./ptdstream-demo",
        help="scratch folder for model.pte and model.ptd, replaced there on every run "
             "(default: %(default)s)",
    )
    parser.add_argument(
        "--no-run", action="store_true",
        help="skip loading the files with the ExecuTorch runtime",
    )
    return parser
