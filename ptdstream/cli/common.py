"""What every ``ptdstream`` command shares: the parser, exit codes, the one mapping
from errors to exit codes and messages, output and input helpers.

Exit codes: 0 ok; 1 mismatch or invalid file, an output that could not be
written (disk full: ENOSPC, EDQUOT, EFBIG), or a failure inside a command;
2 usage error, unreadable input or an output that cannot be created; 130 interrupted.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import FormatError, IntegrityError, LayoutError, MissingKeyError, OverwriteError, PtdstreamError
from .errors import UsageError

__all__ = ["EPILOG", "EXIT_INVALID", "EXIT_OK", "EXIT_USAGE", "EXPECTED_ERRORS", "Parser",
           "add_command", "binary_stdout", "exit_for", "parse_nbytes", "print_error",
           "STDIN_NAME", "print_json", "print_report", "progress_wanted", "quiet_third_party", "silence_stdout",
           "spool_stdin"]

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
#: Errors only a write raises (no room left): an output not written, exit 1.
OUTPUT_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

EPILOG = """\
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
  1  files differ, a file is not a valid .pte/.ptd, or an output could not be written (disk full)
  2  usage error, an input that cannot be read (missing file, permission), or an output that cannot be
     created (its folder missing or not writable)
  130  interrupted (Ctrl-C): one line, no temp file left
"""

#: The exit codes line of a command's own epilog.
EXIT_LINE = ("exit codes: 0 ok, 1 corrupt input, mismatch or output not written (disk full), 2 usage error, "
             "unreadable input or an output that cannot be created, 130 interrupted")


#: Errors users cause (bad arguments, bad or unreadable files, Ctrl-C): reported in
#: one line even with ``PTDSTREAM_DEBUG=1``, which shows tracebacks of the others.
EXPECTED_ERRORS = (UsageError, PtdstreamError, OSError, KeyboardInterrupt)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises :class:`UsageError` instead of printing and exiting."""

    def error(self, message: str):
        """Raise :class:`UsageError` (exit 2) with ``message`` and a pointer to ``--help``, instead of exiting."""
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def add_command(subparsers, name: str, *, help: str, description: str,
                examples: Sequence[tuple[str, str]], run: Callable[[argparse.Namespace], int],
                inputs: Callable[[argparse.Namespace], Sequence[str]] = lambda a: (),
                outputs: Callable[[argparse.Namespace], Sequence[str | None]] | None = None,
                output_folders: Callable[[argparse.Namespace], Sequence[str]] = lambda a: (),
                stdin: Sequence[str] = (), reports: bool = True, progress: bool = False,
                imports_torch: bool = False, exit_codes: str = EXIT_LINE,
                check: Callable[[argparse.Namespace], None] = lambda a: None) -> argparse.ArgumentParser:
    """Register subcommand ``name`` with the options every command shares; return
    its parser for the command's own arguments.

    Args:
        examples: ``(command line, what it does)`` pairs for the command's ``--help``.
        run: ``run(args)`` returns the exit code or raises (mapped by :func:`exit_for`).
        inputs: the files it reads (checked to be regular files before it runs).
        outputs: the files it writes (``None`` entries: stdout). A command with
            outputs gets ``-f/--force``; ``main`` refuses (exit 2) an output that is
            an input, or that exists without ``--force``
            (:func:`ptdstream.system.files.refuse_overwrite`).
        output_folders: the folders it writes files into whose names it learns only
            while it runs: an error on such a folder, a file in it or a parent it
            creates names the folder as an output that cannot be written.
        stdin: names of arguments (a path or a list of paths) where ``-`` means
            standard input (spooled to a temp file: the readers need random access).
        reports: the command prints a report: ``--json`` prints it as JSON, and
            errors as ``{"ok": false, "error": ..., "exit_code": ...}`` on stdout.
        progress: ``--progress``/``--no-progress`` (default: a bar when stderr is a
            terminal, never in logs).
        imports_torch: ``main`` silences the import noise of torch/executorch, after it
            refused a missing input.
        check: ``check(args)`` raises :class:`UsageError` for arguments that cannot be run,
            before ``run`` (and before torch is imported): a usage error answers at once.
    """
    width = max(len(cmd) for cmd, _ in examples) + 3
    epilog = "examples:\n" + "\n".join(f"  {cmd:<{width}}{what}" for cmd, what in examples)
    parser = subparsers.add_parser(name, help=help, description=description, epilog=f"{epilog}\n\n{exit_codes}",
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(run=run, inputs=inputs, outputs=outputs or (lambda a: ()), output_folders=output_folders,
                        force=False, json=False,
                        progress=None, stdin=tuple(stdin), imports_torch=imports_torch, check=check)
    if reports:
        parser.add_argument("--json", action="store_true", help="print the report (or the error) as JSON on stdout")
    if progress:
        parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                            help="progress bar on stderr (default: on when stderr is a terminal)")
    if outputs is not None:
        parser.add_argument("-f", "--force", action="store_true",
                            help="replace an existing output file (never one of the inputs)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show torch/executorch log output and a traceback of an unexpected failure")
    return parser


def progress_wanted(args: argparse.Namespace) -> bool:
    """``--progress``/``--no-progress`` as given, else whether stderr is a terminal;
    never with ``--quiet``."""
    if getattr(args, "quiet", False):
        return False
    if args.progress is not None:
        return bool(args.progress)
    return sys.stderr.isatty()


def binary_stdout():
    """``sys.stdout.buffer`` for binary output.

    Raises:
        UsageError: stdout is a terminal (as zstd, ptdstream never writes binary
            data to one).
    """
    if sys.stdout.isatty():
        raise UsageError("ptdstream: refusing to write binary data to a terminal; give -o FILE or redirect stdout")
    return sys.stdout.buffer


def spool_stdin(folder: str | None = None) -> str:
    """Copy standard input to a temp file named ``stdin`` in a fresh temp folder (the
    caller removes both) and return its path.

    Raises:
        UsageError: stdin is a terminal.
    """
    import shutil
    import tempfile

    if sys.stdin.isatty():
        raise UsageError("ptdstream: refusing to read binary data from a terminal; give a file or redirect stdin")
    path = os.path.join(tempfile.mkdtemp(prefix="ptdstream-", dir=folder), "stdin")
    try:
        with open(path, "xb") as out:
            shutil.copyfileobj(sys.stdin.buffer, out, 8 << 20)
    except BaseException:  # Ctrl-C or a full disk while copying: leave nothing behind
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        raise
    return path


def exit_for(error: BaseException, command: str | None,
             outputs: Sequence[str | None] = (), folders: Sequence[str] = ()) -> tuple[int, str]:
    """The one mapping from an error to ``(exit code, one-line message)``.

    Usage errors, bad parameters and keys a file does not hold exit 2; invalid or
    corrupt input and mismatches exit 1; a write that fails for want of room
    (``ENOSPC``, ``EDQUOT``, ``EFBIG``: an output, file or stdout, not written)
    exits 1; an input that cannot be read or an output that cannot be opened
    (``outputs``: the command's output paths, None for stdout; ``folders``: its
    output folders, see :func:`add_command`) exits 2; Ctrl-C 130.
    Anything else is a failure inside the command (1), in one line.
    """
    if isinstance(error, UsageError):
        return EXIT_USAGE, str(error)
    if isinstance(error, FormatError):
        return EXIT_INVALID, f"ptdstream: invalid file: {error}"
    if isinstance(error, OverwriteError):
        return EXIT_USAGE, f"ptdstream {command}: error: {error}"
    if isinstance(error, (LayoutError, MissingKeyError)):
        return EXIT_USAGE, f"ptdstream {command}: error: {error}"
    if isinstance(error, IntegrityError):
        return EXIT_INVALID, f"ptdstream {command}: error: {error}"
    if isinstance(error, OSError):
        what = error.strerror or str(error) or type(error).__name__
        if error.errno in OUTPUT_FULL_ERRNOS:
            if error.filename:
                written = _output_of(os.fspath(error.filename), outputs, folders) or error.filename
                return EXIT_INVALID, f"ptdstream: cannot write {written}: {what}"
            if None in outputs:
                return EXIT_INVALID, f"ptdstream: cannot write standard output: {what}"
            return EXIT_INVALID, f"ptdstream: {what}"
        if error.filename:
            written = _output_of(os.fspath(error.filename), outputs, folders)
            if written is not None:
                return EXIT_USAGE, f"ptdstream: cannot write {written}: {what}"
            return EXIT_USAGE, f"ptdstream: cannot read {error.filename}: {what}"
        return EXIT_USAGE, f"ptdstream: {what}"
    if isinstance(error, PtdstreamError):
        return EXIT_INVALID, f"ptdstream: {error}"
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "ptdstream: interrupted"
    return EXIT_INVALID, (f"ptdstream: {command} failed: {type(error).__name__}: {error} "
                          "(-v or PTDSTREAM_DEBUG=1 for a traceback)")


def _output_of(path: str, outputs: Sequence[str | None], folders: Sequence[str] = ()) -> str | None:
    """The output that ``path`` is (or whose temp file or folder it is), or the
    output folder that ``path`` is, is in or is a parent of; else None."""
    real = os.path.abspath(path)
    for folder in folders:
        target = os.path.abspath(folder)
        if real == target or os.path.dirname(real) == target or target.startswith(real.rstrip(os.sep) + os.sep):
            return folder
    for output in outputs:
        if output is None:
            continue
        target = os.path.abspath(output)
        folder = os.path.dirname(target)
        if real in (target, folder) or (os.path.dirname(real) == folder and ".ptdstream-" in os.path.basename(real)):
            return output
    return None


def print_error(message: str, *, per_line: bool = False) -> None:
    """One line on stderr (whitespace, newlines included, collapsed); with ``per_line``,
    each line of ``message`` on its own (a list of problems), the later ones indented."""
    if not per_line:
        print(" ".join(str(message).split()) or "error", file=sys.stderr)
        return
    lines = [" ".join(line.split()) for line in str(message).splitlines()]
    lines = [line for line in lines if line] or ["error"]
    print("\n".join([lines[0], *("  " + line for line in lines[1:])]), file=sys.stderr)


#: How reports and errors name standard input (a ``-`` input, read from its temp copy).
STDIN_NAME = "- (stdin)"


class _StdinNamed:
    """A text stream that writes ``spool`` (the temp copy of stdin, and its JSON spelling) as
    :data:`STDIN_NAME`. A report's JSON names a path in one whole string, never split."""

    def __init__(self, stream, spool: str) -> None:
        import json

        self._stream = stream
        self._names = [(spool, STDIN_NAME), (json.dumps(spool)[1:-1], json.dumps(STDIN_NAME)[1:-1])]

    def write(self, text: str) -> int:
        for old, new in self._names:
            text = text.replace(old, new)
        return self._stream.write(text)


def print_report(args: argparse.Namespace, report: Any, stream=None) -> None:
    """A report's JSON with ``--json``, else its summary (stdout by default), unless ``--quiet``.
    A ``-`` input is named :data:`STDIN_NAME`, not by its temp copy."""
    out = stream or sys.stdout
    spool = getattr(args, "stdin_spool", None)
    if spool:
        out = _StdinNamed(out, spool)
    if getattr(args, "json", False):
        report.write_json(out)  # streamed: never the whole text at once
    elif not getattr(args, "quiet", False):
        out.write(report.summary() + "\n")


def print_json(args: argparse.Namespace, value: Any, stream=None) -> None:
    """A plain JSON value (``--json`` output of a command without a report class)."""
    import json

    print(json.dumps(value, indent=2), file=stream or sys.stdout)


def parse_nbytes(text: str) -> int:
    """``"8M"``, ``"8MiB"``, ``"512k"``, ``"1048576"`` -> bytes (K/M/G are powers of 1024)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 8M, 512K, 1048576)") from None


def quiet_third_party() -> None:
    """Keep torch/torchao/executorch import chatter (deprecation warnings, optional
    kernels that fail to load) out of the command's output; ``PTDSTREAM_DEBUG=1``
    shows it."""
    import logging
    import warnings

    if os.environ.get("PTDSTREAM_DEBUG"):
        return
    for category in (DeprecationWarning, FutureWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category)
    for name in ("torchao", "torch.utils._pytree", "torch._export", "executorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # Some of it is printed straight to stderr while torch, torchao and executorch
    # import: import them now with file descriptor 2 pointed at /dev/null.
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        try:
            from ..upstream import adapter

            adapter.preload_serializer()
        except ImportError:
            pass
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def silence_stdout() -> None:
    """Point stdout at /dev/null (after a broken pipe, so exit flushes nothing)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
