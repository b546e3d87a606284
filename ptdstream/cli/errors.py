"""The command line's own error: a command line that cannot be run as given (exit 2)."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """A command line that cannot be run as given (exit 2)."""
