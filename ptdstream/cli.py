"""The ``ptdstream`` command: ``verify``, ``inspect``, ``manifest``, ``pack``,
``unpack``, ``extract`` and ``demo``.

Exit codes: 0 ok; 1 mismatch or invalid file; 2 usage error or unreadable
input (missing file, permission denied). Errors are one line on stderr, never a
traceback. ``python -m ptdstream`` runs the same entry point.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

from .errors import FormatError, PtdstreamError

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2

_EPILOG = """\
examples:
  ptdstream verify out/model.pte --against ref/model.pte     byte identity with a reference
  ptdstream verify model.pte model.ptd                        structure of a program and its data
  ptdstream verify model.pte model.ptd --json                 same, as JSON
  ptdstream inspect model.pte model.ptd                       sections, keys, sizes, duplicates
  ptdstream manifest model.pte model.ptd                      write model.manifest (piece digests)
  ptdstream verify model.pte model.ptd --manifest model.manifest   check copies at disk speed
  ptdstream pack model.ptd model.ptd.zst                      seekable zstd for transport
  ptdstream demo --out /tmp/ptdstream-demo                    export a small LM and save it

exit codes:
  0  ok
  1  files differ, or a file is not a valid .pte/.ptd
  2  usage error, or an input cannot be read (missing file, permission)
"""


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises on usage errors instead of printing and exiting."""

    def error(self, message: str):  # noqa: D401 (argparse API)
        raise _UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``ptdstream`` command."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="ptdstream", description="Verify, inspect, checksum and pack ExecuTorch "
                     ".pte/.ptd artifacts written by ptdstream or by ExecuTorch itself.",
                     epilog=_EPILOG, formatter_class=fmt)
    from . import __version__

    parser.add_argument("--version", action="version", version=f"ptdstream {__version__} (byte identity "
                        "checked against executorch 1.5.1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    v = sub.add_parser(
        "verify", help="compare with a reference, or check the structure of a .pte and its .ptd files",
        description="With --against: compare FILE with REF byte for byte (streamed) and name the first "
                    "difference. Without: check FILE (a .pte) and the .ptd files after it the way the "
                    "runtime loads them, including that every external tensor is in a given .ptd.",
        epilog=_EPILOG, formatter_class=fmt)
    v.add_argument("files", nargs="+", metavar="FILE", help="OUT (with --against), or OUT.pte [DATA.ptd ...]")
    v.add_argument("--against", metavar="REF", help="reference file to compare the single FILE with")
    v.add_argument("--manifest", metavar="M", help="check each FILE against manifest M (piece digests)")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.set_defaults(func=_verify, inputs=lambda a: a.files + [p for p in (a.against, a.manifest) if p])
    i = sub.add_parser("inspect", help="sections, keys, sizes, alignments and duplicated content",
                       description="Show each file's section map, segments with their alignment, keys, a "
                                   "size breakdown (metadata + padding + payload = file size) and content "
                                   "stored more than once.", epilog=_EPILOG, formatter_class=fmt)
    i.add_argument("files", nargs="+", metavar="FILE")
    i.add_argument("--json", action="store_true", help="print the report as JSON")
    i.set_defaults(func=_inspect, inputs=lambda a: a.files)
    m = sub.add_parser("manifest", help="write an integrity manifest (piece digests, sections, key fingerprints)",
                       description="Describe FILEs in a manifest (ptdstream's flatbuffer schema, "
                                   "schema/manifest.fbs): each file's size, sections, the xxh3-128 digest "
                                   "of every piece and each key's fingerprint. Check copies later with "
                                   "`ptdstream verify FILE --manifest M`.", epilog=_EPILOG, formatter_class=fmt)
    m.add_argument("files", nargs="+", metavar="FILE")
    m.add_argument("-o", "--output", metavar="M", help="manifest path (default: <first file without suffix>.manifest)")
    m.add_argument("--piece-size", type=int, default=8 << 20, metavar="BYTES", help="piece size (default 8 MiB)")
    m.set_defaults(func=_manifest, inputs=lambda a: a.files)
    try:
        from .pack_cli import add_pack_commands
    except ImportError:  # pragma: no cover - pack is part of the package
        add_pack_commands = None
    if add_pack_commands is not None:
        add_pack_commands(sub)
    d = sub.add_parser("demo", help="export a small model and save it with ptdstream",
                       description="Export a small transformer LM (tied embeddings, two methods, "
                                   "XNNPACK, weights in a .ptd), stream-save it with ptdstream, verify byte "
                                   "identity against ExecuTorch's serializer (streamed, not written), run it "
                                   "with the ExecuTorch runtime and compare with eager PyTorch.", epilog=_EPILOG, formatter_class=fmt)
    d.add_argument("--out", default="./ptdstream-demo", metavar="DIR", help="output folder (default: %(default)s)")
    d.add_argument("--no-run", action="store_true", help="do not run the saved program")
    d.set_defaults(func=_demo, inputs=lambda a: [])
    return parser


def _err(message: str) -> None:
    print(" ".join(str(message).split()) or "error", file=sys.stderr)


def _unreadable(e: OSError) -> str:
    what = e.strerror or type(e).__name__
    return f"ptdstream: cannot read {e.filename}: {what}" if e.filename else f"ptdstream: {what}"


def _verify(args) -> int:
    from .verify import check_structure, compare_files

    if args.manifest is not None:
        return _verify_manifest(args)
    if args.against is not None:
        if len(args.files) != 1:
            raise _UsageError(f"ptdstream verify: --against compares one FILE, got {len(args.files)} "
                              "(see ptdstream verify --help)")
        report = compare_files(args.files[0], args.against)
    else:
        report = check_structure(args.files[0], args.files[1:])
    print(report.to_json() if args.json else report.summary())
    return EXIT_OK if report.ok else EXIT_INVALID


def _verify_manifest(args) -> int:
    import json

    from .manifest import read_manifest, verify_manifest

    if args.against is not None:
        raise _UsageError("ptdstream verify: use either --against or --manifest (see ptdstream verify --help)")
    manifest = read_manifest(args.manifest)
    checks = [verify_manifest(path, manifest) for path in args.files]
    if args.json:
        print(json.dumps([c.to_json() for c in checks], indent=2))
    else:
        print("\n".join(("OK " if c.ok else "BAD ") + c.message for c in checks))
    return EXIT_OK if all(c.ok for c in checks) else EXIT_INVALID


def _manifest(args) -> int:
    from .manifest import write_manifest

    out = args.output or os.path.splitext(args.files[0])[0] + ".manifest"
    if args.piece_size <= 0:
        raise _UsageError("ptdstream manifest: --piece-size must be > 0")
    manifest = write_manifest(args.files, out, args.piece_size)
    pieces = sum(len(f.pieces) for f in manifest.files)
    print(f"wrote {out}: {len(manifest.files)} file(s), {pieces} piece(s), "
          f"{sum(len(f.keys) for f in manifest.files)} key(s)")
    return EXIT_OK


def _inspect(args) -> int:
    from .inspect import inspect_files

    report = inspect_files(args.files)
    print(report.to_json() if args.json else report.summary())
    return EXIT_OK


def _demo(args) -> int:
    from . import demo

    rc = demo.main(args)
    return int(rc or 0)


def _check_inputs(paths: Sequence[str]) -> None:
    """Refuse, before opening anything, inputs that are not regular files: a
    folder, a FIFO (opening it would block) or a device (it may never end)."""
    import stat

    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            continue  # reported by the command itself, after its usage checks
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(21, "is a directory", path)
        if not stat.S_ISREG(mode):
            raise OSError(22, "not a regular file", path)


def _quiet_third_party() -> None:
    """Keep torch/torchao/executorch import chatter (deprecation warnings, optional
    kernels that fail to load) out of the command's output; ``PTDSTREAM_DEBUG=1``
    shows it."""
    import logging
    import os
    import warnings

    if os.environ.get("PTDSTREAM_DEBUG"):
        return
    for category in (DeprecationWarning, FutureWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category)
    for name in ("torchao", "torch.utils._pytree", "torch._export", "executorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # Some of it is printed straight to stderr while torch, torchao and executorch
    # import: import them now with file descriptor 2 pointed at /dev/null.
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        try:
            import executorch.exir._serialize._flatbuffer_program  # noqa: F401
            import torch  # noqa: F401
        except ImportError:
            pass
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``ptdstream`` command with ``argv`` (default ``sys.argv[1:]``).

    Returns:
        The exit code: 0 ok, 1 mismatch or invalid file, 2 usage error or
        unreadable input. Never raises for user errors; ``--help`` returns 0.
    """
    for stream in (sys.stdout, sys.stderr):
        try:  # file names need not be UTF-8: print them escaped, never fail on them
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError):
            pass
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as e:
        _err(str(e))
        return EXIT_USAGE
    except SystemExit as e:  # --help / --version print and exit
        return int(e.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command in ("verify", "inspect", "demo", "manifest", "extract"):
        _quiet_third_party()
    try:
        inputs = getattr(args, "inputs", None)
        if inputs is not None:
            _check_inputs(inputs(args))
        return int(args.func(args) or 0)
    except _UsageError as e:
        _err(str(e))
        return EXIT_USAGE
    except FormatError as e:
        _err(f"ptdstream: invalid file: {e}")
        return EXIT_INVALID
    except BrokenPipeError:  # output piped into head & co.
        _silence_stdout()
        return EXIT_OK
    except OSError as e:
        _err(_unreadable(e))
        return EXIT_USAGE
    except PtdstreamError as e:
        _err(f"ptdstream: {e}")
        return EXIT_INVALID
    except KeyboardInterrupt:
        _err("ptdstream: interrupted")
        return 130
    except Exception as e:  # a bug or an upstream failure: still one line
        if os.environ.get("PTDSTREAM_DEBUG"):
            raise
        _err(f"ptdstream: {args.command} failed: {type(e).__name__}: {e} (set PTDSTREAM_DEBUG=1 for a traceback)")
        return EXIT_INVALID


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
