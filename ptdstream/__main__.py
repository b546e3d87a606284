"""``python -m ptdstream``: the ``ptdstream`` command (see :mod:`ptdstream.cli`)."""

import sys

from ._entry import main

sys.exit(main())
