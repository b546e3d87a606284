"""``ptdstream manifest``: write an integrity manifest of a set of files."""

from __future__ import annotations

from ..defaults import CHUNK_NBYTES
from .common import EXIT_OK, add_command, print_report
from .errors import UsageError

__all__ = ["check", "register", "run"]


def register(subparsers) -> None:
    """Add ``manifest`` to ``subparsers``."""
    m = add_command(
        subparsers, "manifest",
        help="write an integrity manifest (piece digests, sections, key fingerprints)",
        description="Describe FILEs in a manifest (ptdstream's flatbuffer schema, schema/manifest.fbs): each "
                    "file's size, sections, the xxh3-128 digest of every piece and each key's fingerprint. "
                    "Check copies later with `ptdstream verify FILE --manifest M`.",
        examples=[("ptdstream manifest out/model.pte out/model.ptd", "writes out/model.manifest"),
                  ("ptdstream manifest model.pte model.ptd -o set.manifest -f", "another path, replacing it"),
                  ("ptdstream verify copy/model.pte --manifest out/model.manifest", "check a copy later")],
        run=run, inputs=lambda a: a.files, outputs=lambda a: [_output(a)], check=check)
    m.add_argument("files", nargs="+", metavar="FILE")
    m.add_argument("-o", "--output", metavar="M", help="manifest path (default: <first file without suffix>.manifest)")
    m.add_argument("--piece-size", type=int, default=CHUNK_NBYTES, metavar="BYTES",
                   help="piece size (default 8 MiB, at least 4096)")


def _output(args) -> str:
    """The manifest path: ``-o``, or the first file's path with ``.manifest`` for its suffix."""
    from ..manifest.naming import manifest_path_for

    return args.output or manifest_path_for(args.files[0])


def check(args) -> None:
    """The piece size, before anything is imported.

    Raises:
        UsageError: ``--piece-size`` below one block (4096 bytes).
    """
    from ..manifest.naming import MIN_PIECE_NBYTES

    if args.piece_size < MIN_PIECE_NBYTES:
        raise UsageError(f"ptdstream manifest: --piece-size must be at least {MIN_PIECE_NBYTES} (bytes), "
                         f"got {args.piece_size}")


def run(args) -> int:
    """``ptdstream manifest``: write the integrity manifest of a set of files."""
    from ..manifest.describe import write_manifest_report

    print_report(args, write_manifest_report(args.files, _output(args), args.piece_size))
    return EXIT_OK
