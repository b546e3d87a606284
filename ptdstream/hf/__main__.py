"""``python -m ptdstream.hf``: optimum-cli with ptdstream saving (:func:`ptdstream.hf.main`)."""

import sys

from .cli import main

sys.exit(main())
