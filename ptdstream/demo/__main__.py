"""``python -m ptdstream.demo``: the demo without the ``ptdstream`` command."""

import sys

from .run import main, parser

sys.exit(main(parser().parse_args()))
