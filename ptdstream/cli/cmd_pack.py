"""``ptdstream pack``: compress a file into the seekable zstd format."""

from __future__ import annotations

from ..defaults import CHUNK_NBYTES
from .common import EXIT_OK, add_command, binary_stdout, parse_nbytes, print_report, progress_wanted
from .errors import UsageError

__all__ = ["DEFAULT_LEVEL", "output_path", "register", "run"]

#: ``pack``'s zstd level (:data:`ptdstream.pack.compress.DEFAULT_LEVEL`, which a test
#: compares), for ``--help``: importing ``ptdstream.pack`` imports flatbuffers and numpy.
DEFAULT_LEVEL = 3


def register(subparsers) -> None:
    """Add ``pack`` to ``subparsers``."""
    p = add_command(
        subparsers, "pack", help="compress a file into seekable zstd frames",
        description="Compress IN (a .pte, .ptd or any file; - for stdin) into OUT in the standard seekable zstd "
                    "format: independent frames of --frame-size bytes with content checksums, a seek table at the "
                    "end. Any zstd tool decompresses OUT; `ptdstream unpack` also checks it. OUT defaults to "
                    "IN.zst; - writes to stdout (never to a terminal).",
        examples=[("ptdstream pack model.ptd", "writes model.ptd.zst"),
                  ("ptdstream pack model.ptd -o /data/model.ptd.zst -f", "another path, replacing it"),
                  ("ptdstream pack -l 9 --frame-size 16M -T 4 model.pte model.pte.zst", "level, frames, threads"),
                  ("ptdstream pack model.ptd -o - | ssh host 'cat > model.ptd.zst'", "to stdout")],
        run=run, inputs=lambda a: [a.input], outputs=lambda a: [output_of(a)], stdin=("input",), progress=True)
    p.add_argument("input", metavar="IN", help="file to compress (- for stdin)")
    p.add_argument("output_arg", nargs="?", metavar="OUT", help="packed file to write (same as -o)")
    p.add_argument("-o", "--output", metavar="OUT", help="packed file to write (default IN.zst; - for stdout)")
    p.add_argument("-l", "--level", type=int, default=DEFAULT_LEVEL, help="zstd level, -7..22 (default %(default)s)")
    p.add_argument("--frame-size", type=parse_nbytes, default=CHUNK_NBYTES,
                   help="bytes per frame, e.g. 8M (default 8 MiB)")
    p.add_argument("-T", "--threads", type=int, default=1, help="frames compressed at once (default %(default)s)")
    p.add_argument("--no-checksums", action="store_true", help="leave checksums out of the seek table")
    p.add_argument("--verify", action="store_true", help="decompress each frame after compressing it and compare")


def output_path(args, default=None):
    """The output a command names with ``-o`` or its positional alias (one of them,
    or both the same); ``default`` when neither is given.

    Raises:
        UsageError: the two differ, or neither is given and there is no default.
    """
    given = {o for o in (args.output, getattr(args, "output_arg", None)) if o is not None}
    if len(given) > 1:
        raise UsageError(f"ptdstream {args.command}: OUT and -o name different files ({', '.join(sorted(given))}); "
                         "give one")
    if given:
        return given.pop()
    if default is None:
        raise UsageError(f"ptdstream {args.command}: give the output file (-o OUT, - for stdout)")
    return default


def output_of(args):
    """The packed file (None for stdout)."""
    out = output_path(args, None if args.input == "-" else args.input + ".zst")
    return None if out == "-" else out


def run(args) -> int:
    """``ptdstream pack``: compress a file into seekable zstd."""
    from ..pack.compress import pack

    out = output_of(args)
    report = pack(args.input, out if out is not None else binary_stdout(), level=args.level,
                  frame_nbytes=args.frame_size, threads=args.threads, checksums=not args.no_checksums,
                  verify=args.verify, progress=progress_wanted(args))
    print_report(args, report, stream=None if out is not None else _stderr())
    return EXIT_OK


def _stderr():
    import sys

    return sys.stderr  # stdout holds the packed bytes
