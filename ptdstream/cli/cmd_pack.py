"""``ptdstream pack``: compress a file into the seekable zstd format."""

from __future__ import annotations

from ..defaults import CHUNK_NBYTES
from ..pack.compress import DEFAULT_LEVEL
from .common import EXIT_LINE, EXIT_OK, add_command, parse_nbytes, print_report


def register(subparsers) -> None:
    """Add ``pack`` to ``subparsers``."""
    p = add_command(
        subparsers, "pack", help="compress a file into seekable zstd frames",
        description="Compress IN (a .pte, .ptd or any file) into OUT in the standard seekable zstd format: "
                    "independent frames of --frame-size bytes with content checksums, a seek table at the end. "
                    "Any zstd tool decompresses OUT; `ptdstream unpack` also checks it.",
        epilog="examples:\n  ptdstream pack model.ptd model.ptd.zst\n"
               "  ptdstream pack -l 9 --frame-size 16M -T 4 model.pte model.pte.zst\n" + EXIT_LINE,
        run=run, inputs=lambda a: [a.input], outputs=lambda a: [a.output])
    p.add_argument("input", help="file to compress")
    p.add_argument("output", help="packed file to write (replaced atomically)")
    p.add_argument("-l", "--level", type=int, default=DEFAULT_LEVEL, help="zstd level, -7..22 (default %(default)s)")
    p.add_argument("--frame-size", type=parse_nbytes, default=CHUNK_NBYTES,
                   help="bytes per frame, e.g. 8M (default 8 MiB)")
    p.add_argument("-T", "--threads", type=int, default=1, help="frames compressed at once (default %(default)s)")
    p.add_argument("--no-checksums", action="store_true", help="leave checksums out of the seek table")
    p.add_argument("--verify", action="store_true", help="decompress each frame after compressing it and compare")
    p.add_argument("--progress", action="store_true", help="progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    from ..pack.compress import pack

    print_report(args, pack(args.input, args.output, level=args.level, frame_nbytes=args.frame_size,
                            threads=args.threads, checksums=not args.no_checksums, verify=args.verify,
                            progress=args.progress))
    return EXIT_OK
