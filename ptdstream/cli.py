"""The ``ptdstream`` command: ``verify``, ``inspect`` and ``demo``.

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
  ptdstream verify model.pte --json                           same, as JSON
  ptdstream inspect model.pte model.ptd                       sections, keys, sizes, duplicates
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
    parser = _Parser(prog="ptdstream", description="Check and inspect ExecuTorch .pte/.ptd artifacts.",
                     epilog=_EPILOG, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", metavar="{verify,inspect,demo}", parser_class=_Parser)
    v = sub.add_parser(
        "verify", help="compare with a reference, or check the structure of a .pte and its .ptd files",
        description="With --against: compare FILE with REF byte for byte (streamed) and name the first "
                    "difference. Without: check FILE (a .pte) and the .ptd files after it the way the "
                    "runtime loads them, including that every external tensor is in a given .ptd.",
        epilog=_EPILOG, formatter_class=fmt)
    v.add_argument("files", nargs="+", metavar="FILE", help="OUT (with --against), or OUT.pte [DATA.ptd ...]")
    v.add_argument("--against", metavar="REF", help="reference file to compare the single FILE with")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    i = sub.add_parser("inspect", help="sections, keys, sizes, alignments and duplicated content",
                       description="Show each file's section map, segments with their alignment, keys, a "
                                   "size breakdown (metadata + padding + payload = file size) and content "
                                   "stored more than once.", epilog=_EPILOG, formatter_class=fmt)
    i.add_argument("files", nargs="+", metavar="FILE")
    i.add_argument("--json", action="store_true", help="print the report as JSON")
    d = sub.add_parser("demo", help="export a small model and save it with ptdstream",
                       description="Export a small transformer LM, save it with ptdstream and upstream, "
                                   "and compare.", epilog=_EPILOG, formatter_class=fmt)
    d.add_argument("--out", default="./ptdstream-demo", metavar="DIR", help="output folder (default: %(default)s)")
    d.add_argument("--no-run", action="store_true", help="do not run the saved program")
    return parser


def _err(message: str) -> None:
    print(" ".join(str(message).split()) or "error", file=sys.stderr)


def _unreadable(e: OSError) -> str:
    what = e.strerror or type(e).__name__
    return f"ptdstream: cannot read {e.filename}: {what}" if e.filename else f"ptdstream: {what}"


def _verify(args) -> int:
    from .verify import check_structure, compare_files

    if args.against is not None:
        if len(args.files) != 1:
            raise _UsageError(f"ptdstream verify: --against compares one FILE, got {len(args.files)} "
                              "(see ptdstream verify --help)")
        report = compare_files(args.files[0], args.against)
    else:
        report = check_structure(args.files[0], args.files[1:])
    print(report.to_json() if args.json else report.summary())
    return EXIT_OK if report.ok else EXIT_INVALID


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
    for path in paths:
        if os.path.isdir(path):
            raise IsADirectoryError(21, "is a directory", path)


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


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``ptdstream`` command with ``argv`` (default ``sys.argv[1:]``).

    Returns:
        The exit code: 0 ok, 1 mismatch or invalid file, 2 usage error or
        unreadable input. Never raises for user errors; ``--help`` returns 0.
    """
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
    _quiet_third_party()
    try:
        if args.command == "verify":
            _check_inputs(args.files + ([args.against] if args.against else []))
            return _verify(args)
        if args.command == "inspect":
            _check_inputs(args.files)
            return _inspect(args)
        return _demo(args)
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
