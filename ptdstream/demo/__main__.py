"""``python -m ptdstream.demo``: the demo's own options (``--out``, ``--no-run``); the
``ptdstream demo`` command adds the CLI's common ones (:mod:`ptdstream.cli.cmd_demo`)."""

import argparse
import sys

from . import add_arguments
from .run import main

parser = add_arguments(argparse.ArgumentParser(
    prog="python -m ptdstream.demo",
    description="Export a small model, stream-save it with ptdstream, verify it (see `ptdstream demo --help`)."))
sys.exit(main(parser.parse_args()))
