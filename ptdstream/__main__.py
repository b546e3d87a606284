"""``python -m ptdstream``: the ``ptdstream`` command (see :mod:`ptdstream.cli`)."""

import sys

from .cli import main

sys.exit(main())
