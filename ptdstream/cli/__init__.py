"""The ``ptdstream`` command: one module per subcommand, one error-to-exit mapping.

Each ``cmd_<name>`` module has ``register(subparsers)``, which adds its parser
through :func:`ptdstream.cli.common.add_command` with a ``run(args) -> exit code``
function. :func:`main` parses, then checks what needs neither torch nor the
readers (an empty path refused, inputs that are regular files, exist and are
readable, outputs that are no input and do not exist without ``-f``, standard
output refused when it is an input, each command's own ``check(args)``), all
under start-up's SIGINT handler and before numpy, flatbuffers, zstandard or torch
is imported: a usage error or a missing file answers in the time of Python's
start-up. Then the readers and ``pack`` are imported, still under that handler
(``--help`` imports none of them). Any error maps to an
exit code and a one-line message (:func:`ptdstream.cli.common.exit_for`): 0 ok;
1 mismatch, invalid file or output not written (disk full); 2 usage error,
unreadable input or an output that cannot be created; 130 interrupted. Never a
traceback (``PTDSTREAM_DEBUG=1`` shows one). ``python -m ptdstream`` runs the
same entry point.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys

from ..errors import CheckpointMismatchError
from ..system.files import (
    check_regular_inputs,
    refuse_overwrite,
    refuse_stdin_output,
    refuse_stdout_input,
    stdout_input,
)
from . import (
    cmd_demo,
    cmd_extract,
    cmd_inspect,
    cmd_manifest,
    cmd_pack,
    cmd_recover,
    cmd_unpack,
    cmd_verify,
    cmd_weights,
)
from .common import (
    EPILOG,
    EXIT_OK,
    EXIT_USAGE,
    EXPECTED_ERRORS,
    STDIN_NAME,
    Parser,
    exit_for,
    print_error,
    quiet_third_party,
    silence_stdout,
    spool_stdin,
)
from .errors import UsageError

__all__ = ["main"]

#: The subcommands, in the order ``--help`` lists them.
COMMANDS = (cmd_verify, cmd_inspect, cmd_manifest, cmd_pack, cmd_unpack, cmd_extract, cmd_weights, cmd_recover,
            cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``ptdstream`` command."""
    from .. import __version__
    from ..upstream.names import CHECKED_VERSIONS

    parser = Parser(prog="ptdstream", description="Verify, inspect, checksum and pack ExecuTorch "
                    ".pte/.ptd artifacts written by ptdstream or by ExecuTorch itself.",
                    epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ptdstream {__version__} (byte identity "
                        f"checked against executorch {', '.join(CHECKED_VERSIONS)})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``ptdstream`` command with ``argv`` (default ``sys.argv[1:]``).

    Returns:
        The exit code (see the module docstring). Never raises for user errors;
        ``--help`` returns 0; Ctrl-C at any moment returns 130 after one line.
    """
    for stream in (sys.stdout, sys.stderr):
        try:  # file names need not be UTF-8: print them escaped, never fail on them
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]  # AttributeError is caught
        except (AttributeError, ValueError):
            pass
    args = None
    try:
        parser = build_parser()
        args = _parse(parser, argv)
        if args is None:
            return EXIT_USAGE
        reads_stdin = _reads_stdin(args)
        if not reads_stdin:  # under start-up's handler: these touch no file and create nothing
            _check(args)
        _preload()
        _end_startup()  # before any file is created: Ctrl-C raises KeyboardInterrupt, clean-up runs
        with contextlib.ExitStack() as stack:
            if reads_stdin:  # the checks need the spooled copy of stdin
                _read_stdin(args, stack)
                _check(args)
            if args.imports_torch and not args.verbose:
                quiet_third_party()
            return int(args.run(args) or 0)
    except SystemExit as e:  # --help / --version print and exit
        return int(e.code or 0)
    except BrokenPipeError:  # output piped into head & co.
        silence_stdout()
        return EXIT_OK
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every error becomes one line
        if args is None and "--json" in (sys.argv[1:] if argv is None else argv):
            args = argparse.Namespace(json=True, command=None)  # a usage error of a --json run
        return _report_error(e, args)


def _check(args: argparse.Namespace) -> None:
    """Every check that needs neither torch nor the readers, before either is imported
    (a usage error or a missing input answers at once): empty paths, inputs that are
    no regular files, outputs that are inputs or exist (without ``-f``), a standard
    output open on an input, the command's own ``check(args)``, then every input
    exists and is readable."""
    _refuse_empty_paths(args)
    check_regular_inputs(args.inputs(args))
    if all(os.path.lexists(i) for i in args.inputs(args)):  # else the missing one is reported below
        refuse_overwrite(args.inputs(args), args.outputs(args), args.force)
    refuse_stdout_input(args.inputs(args), hint=_stdout_hint(args))  # every command writes to stdout
    args.check(args)  # the command's own arguments
    _require_inputs(args.inputs(args))


def _reads_stdin(args: argparse.Namespace) -> bool:
    """Whether an argument that may be ``-`` (standard input) is."""
    for name in args.stdin:
        value = getattr(args, name)
        if "-" in (value if isinstance(value, list) else [value]):
            return True
    return False


def _preload() -> None:
    """Import the readers and ``pack`` (flatbuffers, numpy, zstandard) while start-up's
    SIGINT handler is in place (``ptdstream._entry``): a ``KeyboardInterrupt`` inside an
    import can be swallowed by importlib ("Exception ignored in ... _get_module_lock")
    or leave the process to die by the signal. ``--help`` has exited before: it
    imports none of them."""
    import importlib

    importlib.import_module("ptdstream.pack")


def _end_startup() -> None:
    """Give SIGINT back to Python's handler if the entry point's start-up handler
    (``ptdstream._entry``: one line, exit 130 at once) is in place."""
    import signal

    if getattr(signal.getsignal(signal.SIGINT), "ptdstream_startup", False):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _parse(parser: argparse.ArgumentParser, argv) -> argparse.Namespace | None:
    """Parsed arguments, or None after printing the top-level help (no command).

    Raises:
        UsageError: bad arguments; an unknown option after a command points at
            that command's ``--help``.
    """
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        if extra:
            parser.parse_args(argv)  # raises with argparse's own message
        parser.print_help(sys.stderr)
        return None
    if extra:
        raise UsageError(f"ptdstream {args.command}: unrecognized arguments: {' '.join(extra)} "
                         f"(see ptdstream {args.command} --help)")
    return args


def _stdout_hint(args: argparse.Namespace) -> str:
    """What to do instead of writing to a stdout that is an input: a command whose data
    goes to stdout (an output named None: ``-o -`` or its default) can write a file with
    ``-o``; the others print only their report there."""
    try:
        to_stdout = None in list(args.outputs(args))
    except Exception:  # noqa: BLE001 - the outputs themselves are wrong: the command reports that
        to_stdout = False
    return "redirect stdout to another file" + (" or give -o OUT" if to_stdout else "")


def _require_inputs(paths) -> None:
    """Refuse a missing or unreadable input before the readers (and torch) are imported.

    Raises:
        OSError: naming the first such path, with the reason ``open`` would give
            (``FileNotFoundError``, ``NotADirectoryError``, ``PermissionError``).
    """
    import errno

    for path in paths:
        os.stat(path)  # raises naming it: missing, a file on its path, a folder it may not search
        if not os.access(path, os.R_OK):
            raise PermissionError(errno.EACCES, "Permission denied", path)


def _refuse_empty_paths(args: argparse.Namespace) -> None:
    """Refuse an empty path (``""``) as the output or an input: it names no file.

    Raises:
        UsageError: naming the option (``-o``, ``OUT``), or the input.
    """
    for name, option in (("output", "-o"), ("output_arg", "OUT")):
        if getattr(args, name, None) == "":
            raise UsageError(f"ptdstream {args.command}: {option}: an empty path, cannot write there; "
                             "give a file name")
    if "" in _inputs(args):
        raise UsageError(f"ptdstream {args.command}: an empty path as an input file; give a file name")


def _read_stdin(args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
    """Replace a ``-`` input by a temp copy of stdin (removed when ``stack`` closes).

    Raises:
        OverwriteError: stdin is the file stdout is open on, or one of the outputs
            (checked before the copy: afterwards the input is the copy).
    """
    for name in args.stdin:
        value = getattr(args, name)
        values = value if isinstance(value, list) else [value]
        if "-" not in values:
            continue
        if values.count("-") > 1:
            raise UsageError(f"ptdstream {args.command}: stdin (-) can be read once")
        refuse_stdout_input(["-"], hint=_stdout_hint(args))  # before the copy: afterwards the input is the copy
        refuse_stdin_output(args.outputs(args))
        path = spool_stdin()
        args.stdin_spool = path  # errors name it as "-", not as the temp copy
        stack.callback(shutil.rmtree, os.path.dirname(path), True)
        spooled = [path if v == "-" else v for v in values]
        setattr(args, name, spooled if isinstance(value, list) else spooled[0])


def _report_error(error: BaseException, args: argparse.Namespace | None) -> int:
    """One line on stderr (and the error as JSON on stdout with ``--json``); the exit code."""
    verbose = bool(os.environ.get("PTDSTREAM_DEBUG")) or bool(getattr(args, "verbose", False))
    if verbose and not isinstance(error, EXPECTED_ERRORS):
        import traceback

        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    outputs = ()
    if args is not None:
        try:
            outputs = tuple(args.outputs(args))
        except Exception:  # noqa: BLE001 - the outputs themselves were the problem
            outputs = ()
    code, message = exit_for(error, getattr(args, "command", None), outputs, _output_folders(args, error))
    problems = isinstance(error, CheckpointMismatchError)  # its problems, one per line
    one_line = problems and bool(getattr(args, "quiet", False))  # -q: the first of them
    line = _quiet_line(error) if one_line and isinstance(error, CheckpointMismatchError) else message
    spool = getattr(args, "stdin_spool", None)
    if spool:
        message, line = message.replace(spool, STDIN_NAME), line.replace(spool, STDIN_NAME)
    print_error(line, per_line=problems and not one_line)
    if args is not None and getattr(args, "json", False) and stdout_input(_inputs(args)) is None:
        try:
            obj: dict = {"ok": False, "error": " ".join(message.split()), "exit_code": code}
            if isinstance(error, CheckpointMismatchError):  # each problem as it is, not joined
                obj["problems"] = [p.replace(spool, STDIN_NAME) if spool else p for p in error.problems]
            print(json.dumps(obj, indent=2))
        except BrokenPipeError:
            silence_stdout()
    return code


def _output_folders(args: argparse.Namespace | None, error: BaseException) -> tuple[str, ...]:
    """The command's output folders, none when the error is about one of its inputs
    (an input may lie in an output folder)."""
    if args is None or getattr(error, "filename", None) is None:
        return ()
    try:
        filename = os.path.abspath(os.fspath(error.filename))  # type: ignore[attr-defined]  # checked above
        if filename in {os.path.abspath(i) for i in args.inputs(args)}:
            return ()
        return tuple(args.output_folders(args))
    except Exception:  # noqa: BLE001 - the arguments themselves were the problem
        return ()


def _quiet_line(error: CheckpointMismatchError) -> str:
    """The one line ``-q`` prints for a checkpoint that does not fit: the first
    problem and how many more there are (as verify's one line for a failed check)."""
    first, n = error.problems[0] if error.problems else "", len(error.problems)
    more = f" (and {n - 1} more problem{'s' * (n != 2)})" if n > 1 else ""
    return f"ptdstream: {error.checkpoint} does not fit {error.program} (nothing written): {first}{more}"


def _inputs(args: argparse.Namespace) -> list[str]:
    """The command's inputs, or none when they cannot be told."""
    try:
        return list(args.inputs(args))
    except Exception:  # noqa: BLE001 - a usage error before the inputs were parsed
        return []


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
