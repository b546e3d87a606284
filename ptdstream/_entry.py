"""The ``ptdstream`` command's entry point and its Ctrl-C handling at start-up and exit.

In the ``ptdstream`` process (the console script, or ``python -m ptdstream``), a
SIGINT is one line on stderr (``ptdstream: interrupted``) and exit 130 from the
first line of ``ptdstream/__init__.py`` on, never a traceback, never carried on:

* start-up (imports, argument parsing): the handler installed by
  :func:`guard_startup` writes the line and ends the process at once
  (``os._exit(130)``). Nothing has been created yet, and a handler that exits
  cannot be swallowed (a ``KeyboardInterrupt`` raised inside an ``except
  BaseException``, a finalizer or a callback can be);
* the command (from when :func:`ptdstream.cli.main` has parsed the arguments,
  before it reads stdin or touches a file): Python's own handler again, so
  ``KeyboardInterrupt`` unwinds through the clean-up and ``cli.main`` reports it;
* after the command returned: SIGINT is taken over first, then the output is
  flushed (a SIGINT meanwhile waits for the flush), then a SIGINT ends the process
  at once with the command's exit code (``os._exit``) while the interpreter waits
  for threads, and from its first exit handler on (an :mod:`atexit` handler
  registered then, so it runs before the others, which all still run) SIGINT is
  ignored (``SIG_IGN``): the interpreter's shutdown puts a Python handler back
  to the default action, which would end the process by the signal, but leaves
  an ignored one. The process ends with the command's exit code, never by the
  signal, with no traceback (a SIGINT on ``cli.main``'s way out, before it
  returned, is the one line and exit 130).

Only the main thread of the ``ptdstream`` process is affected, and only while
SIGINT has Python's default handler: ``import ptdstream`` in any other program,
an inherited ``SIG_IGN`` (a background job) and in-process calls of
:func:`main` keep theirs. Before the interpreter runs ``ptdstream/__init__.py``
(its own start-up, ``site``) a SIGINT is the interpreter's to handle.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys

__all__ = ["guard_startup", "is_command", "main"]

_LINE = b"ptdstream: interrupted\n"
_INTERRUPTED = 130


def is_command() -> bool:
    """Whether this process is the ``ptdstream`` command: the console script
    (``sys.argv[0]`` named ``ptdstream``) or ``python -m ptdstream``."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0).lower() in ("ptdstream", "ptdstream.exe", "ptdstream-script.py"):
        return True
    if argv0 == "-m":  # python -m: sys.argv[0] is "-m" while the package imports
        orig = list(getattr(sys, "orig_argv", ()))
        return any(a == "-mptdstream" or (a == "-m" and orig[i + 1 : i + 2] == ["ptdstream"])
                   for i, a in enumerate(orig))
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "ptdstream.__main__"


def _exit_interrupted(signum, frame) -> None:
    """Start-up: the one line, then exit 130 at once."""
    try:
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - stderr may be closed or mid-write
        pass
    try:
        os.write(2, _LINE)
    except OSError:
        pass
    os._exit(_INTERRUPTED)


_exit_interrupted.ptdstream_startup = True  # type: ignore[attr-defined]  # a function-object marker, read by getattr
_exit_interrupted.ptdstream_handler = True  # type: ignore[attr-defined]  # a function-object marker, read by getattr


def _swap(handler) -> bool:
    """Install ``handler`` for SIGINT if Python's default handler or one of ours is in
    place (main thread only); True if it was installed."""
    try:
        current = signal.getsignal(signal.SIGINT)
        if current is not signal.default_int_handler and not getattr(current, "ptdstream_handler", False):
            return False
        signal.signal(signal.SIGINT, handler)
    except (ValueError, OSError):  # not the main thread
        return False
    return True


def guard_startup() -> bool:
    """In the ``ptdstream`` process (:func:`is_command`), make SIGINT exit at once with
    the one line until the arguments are parsed; elsewhere do nothing. True if installed."""
    return is_command() and _swap(_exit_interrupted)


def _end_startup() -> None:
    """Give SIGINT back to Python's handler (``KeyboardInterrupt``) if the start-up
    handler is in place; anything else is left as it is (``cli.main`` does the same)."""
    if getattr(signal.getsignal(signal.SIGINT), "ptdstream_startup", False):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _finish(code: int) -> int:
    """After the command returned ``code``: take SIGINT over, flush its output, then
    let a SIGINT end the process with ``code`` (only in the ``ptdstream`` process):
    one during the flush is held until the flush is done, one later ends the
    process at once, and from the first exit handler on it is ignored (module
    docstring)."""
    if not is_command():
        _end_startup()
        return code
    held = []

    def hold(signum, frame) -> None:  # mid-flush: the rest of the output first
        held.append(signum)

    hold.ptdstream_handler = True  # type: ignore[attr-defined]  # a function-object marker, read by getattr
    installed = _swap(hold)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: cli.main has reported what it could
            pass

    def finished(signum, frame) -> None:
        os._exit(code)

    finished.ptdstream_handler = True  # type: ignore[attr-defined]  # a function-object marker, read by getattr
    _swap(finished)
    if held:
        os._exit(code)
    if installed:
        atexit.register(_ignore_if, finished)
    return code


def _ignore_if(handler) -> None:
    """Ignore SIGINT from here on if ``handler`` is still SIGINT's handler (an exit
    handler: the interpreter's shutdown would put a Python handler back to SIG_DFL)."""
    try:
        if signal.getsignal(signal.SIGINT) is handler:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError):  # not the main thread
        pass


def main() -> int:
    """Import the command line and run it (see :func:`ptdstream.cli.main`)."""
    guard_startup()  # already done by ptdstream/__init__.py in the ptdstream process
    try:
        from .cli import main as run

        code = run()
    except KeyboardInterrupt:  # the import where the start-up handler is not installed, or cli.main's return
        print("ptdstream: interrupted", file=sys.stderr)
        code = _INTERRUPTED
    try:
        return _finish(code)
    except KeyboardInterrupt:  # before _finish took SIGINT over: the command had returned ``code``
        return _finish(code)
