"""``ptdstream unpack``: a seekable zstd file back to the original, every frame checked."""

from __future__ import annotations

from .common import EXIT_LINE, EXIT_OK, add_command, print_report


def register(subparsers) -> None:
    """Add ``unpack`` to ``subparsers``."""
    u = add_command(
        subparsers, "unpack", help="decompress a packed file, checking every frame",
        description="Decompress IN (seekable zstd) into OUT frame by frame in bounded memory. Every frame's "
                    "checksums and sizes, and the whole content's xxh3-128 when IN was packed by ptdstream, are "
                    "checked before OUT is published; on any error OUT is left as it was.",
        epilog="examples:\n  ptdstream unpack model.ptd.zst model.ptd\n" + EXIT_LINE,
        run=run, inputs=lambda a: [a.input], outputs=lambda a: [a.output])
    u.add_argument("input", help="packed file")
    u.add_argument("output", help="file to write (replaced atomically)")
    u.add_argument("--progress", action="store_true", help="progress bar on stderr")
    u.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    from ..pack.decompress import unpack

    print_report(args, unpack(args.input, args.output, progress=args.progress))
    return EXIT_OK
