"""The exceptions ptdstream raises.

Every error derives from :class:`PtdstreamError`. Messages name the key, the
file and the offset involved and, where a number disagrees, both numbers.

Every error class of the package lives here or in a way in's own ``errors``
module (:mod:`ptdstream.weightless.errors`, :mod:`ptdstream.distributed.errors`;
:mod:`ptdstream.cli.errors` and :mod:`ptdstream.check.runtime.errors` hold
internal ones), and every public one is reachable from the package root
(``ptdstream.BindingError``); ``tests/test_structure.py`` checks both.

Upstream-compatible errors are kept as upstream raises them: a duplicate key
with different data is a plain ``ValueError`` with upstream's exact text
(``exir/_serialize/_named_data_store.py``), so code written against
``NamedDataStore`` keeps working.
"""

from __future__ import annotations

__all__ = ["ArgumentTypeError", "CheckpointFileError", "CheckpointMismatchError", "FlatbufferError", "FormatError",
           "IntegrityError", "LayoutError", "MissingKeyError", "OverwriteError", "PtdstreamError", "RecoveryError",
           "StateError"]


class PtdstreamError(Exception):
    """Base class of every error raised by ptdstream."""


class FormatError(PtdstreamError):
    """A file is not a valid .pte/.ptd: bad magic, a size field beyond the file, a
    flatbuffer that does not parse. Raised by the reader, verify and inspect."""


class CheckpointFileError(FormatError, OSError):
    """A file a checkpoint's index names cannot be used: missing from the folder,
    unreadable (a folder in its place, no permission), or outside the folder. The
    message (one line) names the index, the file and the keys it holds;
    ``filename`` is the file, ``errno`` the system's error (None for a name
    outside the folder). Raised before anything is read or written; an
    ``OSError`` too, so code that catches the system's error still does."""

    def __init__(self, errno: int | None, message: str, filename: str | None = None) -> None:
        super().__init__(errno, message, filename)

    def __str__(self) -> str:
        return str(self.strerror)


class LayoutError(PtdstreamError, ValueError):
    """A layout parameter or name is not allowed: a non-positive alignment, an
    external tag that would leave the output folder, an unsupported source."""


class IntegrityError(PtdstreamError):
    """A source changed between plan and write (size, first bytes or digest), a
    source could not be read in full, or a tensor's storage was freed. Nothing is
    published when this is raised."""


class ArgumentTypeError(PtdstreamError, TypeError):
    """An argument of a type the function does not take (a ``progress`` that is
    neither a bool, None nor a callable); the message names the argument, the
    value given and what is accepted. Raised before any work starts."""


class StateError(PtdstreamError, RuntimeError):
    """A sink or writer method was called in the wrong state (for example
    ``write`` after ``commit``)."""


class MissingKeyError(PtdstreamError, KeyError):
    """A key or segment index that the packed artifact does not hold."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CheckpointMismatchError(PtdstreamError, ValueError):
    """A checkpoint does not fit a program: missing, extra, mis-typed or
    mis-shaped keys, or weights a checkpoint cannot recreate (a delegate's).
    ``problems`` lists every one, by key; the message holds them one per line."""

    def __init__(self, program: str, checkpoint: str, problems) -> None:
        self.program = program
        self.checkpoint = checkpoint
        self.problems = list(problems)
        super().__init__(
            f"{checkpoint} does not fit {program} ({len(self.problems)} problem(s); nothing written):\n  "
            + "\n  ".join(self.problems)
        )


class OverwriteError(PtdstreamError):
    """An output that would destroy a file it should not: the output is one of
    the inputs (same device and inode, through links too), or, for the command
    line without ``-f/--force``, an existing file. Nothing was written."""


class FlatbufferError(FormatError):
    """A flatbuffer the runtime's verifier would refuse. ``offset`` is the byte offset
    (from the flatbuffer's start) of the first bad field; ``what`` says what is wrong."""

    def __init__(self, offset: int, what: str) -> None:
        super().__init__(f"at offset {offset}: {what}")
        self.offset, self.what = offset, what


class RecoveryError(PtdstreamError):
    """A journal that cannot be completed in either direction (unreadable, naming
    files outside its folder or not of ptdstream's shape, or its files changed by
    another program); it is left in place with every file, named in the message."""
