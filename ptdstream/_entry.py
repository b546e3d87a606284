"""The ``ptdstream`` command's entry point: Ctrl-C while the command's own modules
import is reported like Ctrl-C anywhere else (one line, exit 130)."""

from __future__ import annotations

import sys


def main() -> int:
    """Import the command line and run it (see :func:`ptdstream.cli.main`)."""
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        print("ptdstream: interrupted", file=sys.stderr)
        return 130
    return run()
