"""``python -m ptdstream.demo``: ``ptdstream demo`` (see :mod:`ptdstream.cli.cmd_demo`)."""

import sys

from ..cli import main

sys.exit(main(["demo", *sys.argv[1:]]))
