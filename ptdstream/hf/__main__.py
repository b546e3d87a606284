"""``python -m ptdstream.hf``: optimum-cli with ptdstream saving (see :mod:`ptdstream.hf.cli`).

The process's own entry point: only here is the pinned stack's known noise dropped
(:mod:`ptdstream.hf.noise`); ``ptdstream.hf.main()`` called from a user's code leaves
the user's filters alone.
"""

import sys

from .cli import main
from .noise import silence_known_noise

silence_known_noise()
sys.exit(main())
