"""The ``pack``, ``unpack`` and ``extract`` subcommands (argparse glue for :mod:`ptdstream.pack`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from .errors import FormatError, IntegrityError, LayoutError, MissingKeyError
from .pack import (
    DEFAULT_FRAME_NBYTES,
    DEFAULT_LEVEL,
    PackedArtifact,
    pack,
    unpack,
)
from .reader import Artifact

_EXIT = "exit codes: 0 ok, 1 corrupt input or mismatch, 2 usage error or unreadable input"


def parse_nbytes(text: str) -> int:
    """``"8M"``, ``"8MiB"``, ``"512k"``, ``"1048576"`` -> bytes (K/M/G are powers of 1024)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 8M, 512K, 1048576)") from None


def _run(name: str, args, body) -> int:
    """``body()``'s exit code; 1 for corrupt input, 2 for usage errors and unreadable files."""
    try:
        return body()
    except OSError as e:
        what = e.strerror or str(e)
        where = f"cannot read {e.filename}: " if e.filename else ""
        print(f"ptdstream {name}: {where}{what}", file=sys.stderr)
        return 2
    except (FormatError, IntegrityError, LayoutError, MissingKeyError) as e:
        print(f"ptdstream {name}: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, (FormatError, IntegrityError)) else 2


def _report(args, report) -> int:
    print(report.to_json() if args.json else report.summary())
    return 0


def _cmd_pack(args) -> int:
    return _run("pack", args, lambda: _report(args, pack(
        args.input, args.output, level=args.level, frame_nbytes=args.frame_size, threads=args.threads,
        checksums=not args.no_checksums, verify=args.verify, progress=args.progress)))


def _cmd_unpack(args) -> int:
    return _run("unpack", args, lambda: _report(args, unpack(args.input, args.output, progress=args.progress)))


def _cmd_extract(args) -> int:
    def body() -> int:
        if not args.list and (args.key is None) == (args.segment is None):
            print("ptdstream extract: error: give exactly one of KEY or --segment INDEX (or --list)", file=sys.stderr)
            return 2
        with PackedArtifact(args.packed) as packed:
            if args.list:
                return _list(packed.artifact, args)
            report = packed.extract(args.output, args.key, args.segment, stream=sys.stdout.buffer)
            sys.stdout.flush()
            out = sys.stdout if args.output is not None else sys.stderr  # stdout may hold the bytes
            print(json.dumps(asdict(report), indent=2) if args.json else report.summary(), file=out)
            return 0
    return _run("extract", args, body)


def _list(art: Artifact, args) -> int:
    rows = [dict(segment=s.index, offset=s.start, nbytes=s.nbytes, label=s.label, keys=list(s.keys))
            for s in art.segments]
    if args.json:
        print(json.dumps({"kind": art.kind, "nbytes": art.file_nbytes, "segments": rows}, indent=2))
        return 0
    print(f"{args.packed}: {art.kind}, {art.file_nbytes:,} bytes, {len(rows)} segments")
    for r in rows:
        keys = f"  keys: {', '.join(r['keys'])}" if r["keys"] else ""
        print(f"  segment {r['segment']:>4}  offset {r['offset']:>14,}  {r['nbytes']:>14,} bytes  {r['label']}{keys}")
    return 0


def add_pack_commands(subparsers) -> None:
    """Register ``pack``, ``unpack`` and ``extract`` on an argparse subparsers object;
    each sets ``func(args) -> exit code`` (0 ok, 1 corrupt/mismatch, 2 usage/unreadable)."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser(
        "pack", help="compress a file into seekable zstd frames", formatter_class=fmt,
        description="Compress IN (a .pte, .ptd or any file) into OUT in the standard seekable zstd format: "
        "independent frames of --frame-size bytes with content checksums, a seek table at the end. "
        "Any zstd tool decompresses OUT; `ptdstream unpack` also checks it.",
        epilog="examples:\n  ptdstream pack model.ptd model.ptd.zst\n"
        "  ptdstream pack -l 9 --frame-size 16M -T 4 model.pte model.pte.zst\n" + _EXIT)
    p.add_argument("input", help="file to compress")
    p.add_argument("output", help="packed file to write (replaced atomically)")
    p.add_argument("-l", "--level", type=int, default=DEFAULT_LEVEL, help="zstd level, -7..22 (default %(default)s)")
    p.add_argument("--frame-size", type=parse_nbytes, default=DEFAULT_FRAME_NBYTES,
                   help="bytes per frame, e.g. 8M (default 8 MiB)")
    p.add_argument("-T", "--threads", type=int, default=1, help="frames compressed at once (default %(default)s)")
    p.add_argument("--no-checksums", action="store_true", help="leave checksums out of the seek table")
    p.add_argument("--verify", action="store_true", help="decompress each frame after compressing it and compare")
    p.add_argument("--progress", action="store_true", help="progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_pack)

    u = subparsers.add_parser(
        "unpack", help="decompress a packed file, checking every frame", formatter_class=fmt,
        description="Decompress IN (seekable zstd) into OUT frame by frame in bounded memory. Every frame's "
        "checksums and sizes, and the whole content's xxh3-128 when IN was packed by ptdstream, are checked "
        "before OUT is published; on any error OUT is left as it was.",
        epilog="examples:\n  ptdstream unpack model.ptd.zst model.ptd\n" + _EXIT)
    u.add_argument("input", help="packed file")
    u.add_argument("output", help="file to write (replaced atomically)")
    u.add_argument("--progress", action="store_true", help="progress bar on stderr")
    u.add_argument("--json", action="store_true", help="print the report as JSON")
    u.set_defaults(func=_cmd_unpack)

    e = subparsers.add_parser(
        "extract", help="read one key or segment from a packed .pte/.ptd", formatter_class=fmt,
        description="Write the bytes of named-data KEY (or of segment --segment) of the .pte/.ptd packed in "
        "PACKED, decompressing only the frames of its metadata and of that segment.",
        epilog="examples:\n  ptdstream extract model.ptd.zst --list\n"
        "  ptdstream extract model.ptd.zst l1.weight -o l1.weight.bin\n"
        "  ptdstream extract model.pte.zst --segment 0 > delegate.bin\n" + _EXIT)
    e.add_argument("packed", help="packed .pte/.ptd")
    e.add_argument("key", nargs="?", help="named-data key")
    e.add_argument("--segment", type=int, help="segment index instead of a key")
    e.add_argument("-o", "--output", help="file to write (default: stdout)")
    e.add_argument("--list", action="store_true", help="list segments and keys, extract nothing")
    e.add_argument("--json", action="store_true", help="print the report (or list) as JSON")
    e.set_defaults(func=_cmd_extract)
