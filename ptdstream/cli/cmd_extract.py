"""``ptdstream extract``: one key or segment of a packed .pte/.ptd, or the list of them."""

from __future__ import annotations

import sys

from .common import EXIT_OK, add_command, binary_stdout, print_json, print_report
from .errors import UsageError

__all__ = ["check", "register", "run"]


def register(subparsers) -> None:
    """Add ``extract`` to ``subparsers``."""
    e = add_command(
        subparsers, "extract", help="read one key or segment from a packed .pte/.ptd",
        description="Write the bytes of named-data KEY (or of segment --segment) of the .pte/.ptd packed in "
                    "PACKED, decompressing only the frames of its metadata and of that segment.",
        examples=[("ptdstream extract model.ptd.zst --list", "segments and keys"),
                  ("ptdstream extract model.ptd.zst pos_embeddings -o pos.bin", "one key into a file"),
                  ("ptdstream extract model.pte.zst --segment 0 > delegate.bin", "one segment to stdout")],
        run=run, inputs=lambda a: [a.packed], outputs=lambda a: [_output(a)], stdin=("packed",), check=check)
    e.add_argument("packed", help="packed .pte/.ptd")
    e.add_argument("key", nargs="?", help="named-data key")
    e.add_argument("--segment", type=int, help="segment index instead of a key")
    e.add_argument("-o", "--output", metavar="OUT", help="file to write (default and -: stdout, never a terminal)")
    e.add_argument("--list", action="store_true", help="list segments and keys, extract nothing")


def check(args) -> None:
    """The arguments, before the packed file is read.

    Raises:
        UsageError: ``--list`` with a KEY or ``--segment``; else not exactly one of them.
    """
    if args.list and (args.key is not None or args.segment is not None):
        given = f"KEY {args.key!r}" if args.key is not None else f"--segment {args.segment}"
        raise UsageError(f"ptdstream extract: --list takes no KEY or --segment (got {given}); it extracts "
                         "nothing: leave out --list to extract, or the key to list")
    if not args.list and (args.key is None) == (args.segment is None):
        raise UsageError("ptdstream extract: give exactly one of KEY or --segment INDEX (or --list)")


def run(args) -> int:
    """``ptdstream extract``: list a packed file's keys, or write one key's or segment's bytes."""
    from ..pack.extract import PackedArtifact

    with PackedArtifact(args.packed) as packed:
        if args.list:
            return _list(packed.artifact, args)
        out = _output(args)
        report = packed.extract(out, args.key, args.segment, stream=None if out is not None else binary_stdout())
        sys.stdout.flush()
        # stdout may hold the extracted bytes: then the report goes to stderr
        print_report(args, report, stream=sys.stdout if out is not None else sys.stderr)
        return EXIT_OK


def _output(args):
    """The file to write (None for stdout)."""
    return None if args.output in (None, "-") else args.output


def _list(art, args) -> int:
    from ..format.fb_roots import shown

    rows = [dict(segment=s.index, offset=s.start, nbytes=s.nbytes, label=s.label, keys=list(s.keys))
            for s in art.segments]
    if args.json:
        print_json(args, {"kind": art.kind, "nbytes": art.file_nbytes, "segments": rows})
        return EXIT_OK
    print(f"{args.packed}: {art.kind}, {art.file_nbytes:,} bytes, {len(rows)} segments")
    for r in rows:
        keys = f"  keys: {', '.join(shown(k) for k in r['keys'])}" if r["keys"] else ""
        print(f"  segment {r['segment']:>4}  offset {r['offset']:>14,}  {r['nbytes']:>14,} bytes  {r['label']}{keys}")
    return EXIT_OK
