"""``ptdstream unpack``: a seekable zstd file back to the original, every frame checked."""

from __future__ import annotations

import sys

from .cmd_pack import output_path
from .common import EXIT_OK, add_command, binary_stdout, print_report, progress_wanted
from .errors import UsageError

__all__ = ["register", "run"]


def register(subparsers) -> None:
    """Add ``unpack`` to ``subparsers``."""
    u = add_command(
        subparsers, "unpack", help="decompress a packed file, checking every frame",
        description="Decompress IN (seekable zstd; - for stdin) into OUT frame by frame in bounded memory. Every "
                    "frame's checksums and sizes, and the whole content's xxh3-128 when IN was packed by "
                    "ptdstream, are checked before OUT is published; on any error OUT is left as it was. OUT "
                    "defaults to IN without its .zst suffix; - writes to stdout (never to a terminal), each frame "
                    "once it is checked.",
        examples=[("ptdstream unpack model.ptd.zst", "writes model.ptd"),
                  ("ptdstream unpack model.ptd.zst -o restored.ptd", "another path"),
                  ("ptdstream unpack model.ptd.zst - | ptdstream inspect -", "to stdout")],
        run=run, inputs=lambda a: [a.input], outputs=lambda a: [output_of(a)], stdin=("input",), progress=True)
    u.add_argument("input", metavar="IN", help="packed file (- for stdin)")
    u.add_argument("output_arg", nargs="?", metavar="OUT", help="file to write (same as -o)")
    u.add_argument("-o", "--output", metavar="OUT", help="file to write (default IN without .zst; - for stdout)")


def output_of(args):
    """The unpacked file (None for stdout)."""
    default = args.input[: -len(".zst")] if args.input.endswith(".zst") and args.input != ".zst" else None
    if default is None and args.output is None and args.output_arg is None:
        raise UsageError(f"ptdstream unpack: {args.input} does not end with .zst: give the output file (-o OUT)")
    out = output_path(args, default)
    return None if out == "-" else out


def run(args) -> int:
    """``ptdstream unpack``: decompress a packed file."""
    from ..pack.decompress import unpack

    out = output_of(args)
    report = unpack(args.input, out if out is not None else binary_stdout(), progress=progress_wanted(args))
    print_report(args, report, stream=None if out is not None else sys.stderr)
    return EXIT_OK
