"""The ``ptdstream`` command: one module per subcommand, one error-to-exit mapping.

Each ``cmd_<name>`` module has ``register(subparsers)``, which adds its parser
through :func:`ptdstream.cli.common.add_command` with a ``run(args) -> exit code``
function. :func:`main` parses, checks the inputs, runs, and maps any error to an
exit code and a one-line message (:func:`ptdstream.cli.common.exit_for`): 0 ok;
1 mismatch or invalid file; 2 usage error or unreadable input (missing file,
permission denied); 130 interrupted. Never a traceback (``PTDSTREAM_DEBUG=1``
shows one). ``python -m ptdstream`` runs the same entry point.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from ..system.files import check_regular_inputs, refuse_overwrite
from . import (cmd_demo, cmd_extract, cmd_inspect, cmd_manifest, cmd_pack, cmd_recover, cmd_unpack,
               cmd_verify, cmd_weights)
from .common import (EPILOG, EXIT_OK, EXIT_USAGE, EXPECTED_ERRORS, Parser, UsageError, exit_for, print_error,
                     quiet_third_party, silence_stdout)

#: The subcommands, in the order ``--help`` lists them.
COMMANDS = (cmd_verify, cmd_inspect, cmd_manifest, cmd_pack, cmd_unpack, cmd_extract, cmd_weights, cmd_recover,
            cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``ptdstream`` command."""
    from .. import __version__
    from ..executorch.names import CHECKED_VERSIONS

    parser = Parser(prog="ptdstream", description="Verify, inspect, checksum and pack ExecuTorch "
                    ".pte/.ptd artifacts written by ptdstream or by ExecuTorch itself.",
                    epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ptdstream {__version__} (byte identity "
                        f"checked against executorch {', '.join(CHECKED_VERSIONS)})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``ptdstream`` command with ``argv`` (default ``sys.argv[1:]``).

    Returns:
        The exit code (see the module docstring). Never raises for user errors;
        ``--help`` returns 0.
    """
    for stream in (sys.stdout, sys.stderr):
        try:  # file names need not be UTF-8: print them escaped, never fail on them
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError):
            pass
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print_error(str(e))
        return EXIT_USAGE
    except SystemExit as e:  # --help / --version print and exit
        return int(e.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.imports_torch:
        quiet_third_party()
    try:
        check_regular_inputs(args.inputs(args))
        if all(os.path.lexists(i) for i in args.inputs(args)):  # else the command reports the missing one
            refuse_overwrite(args.inputs(args), args.outputs(args), args.force)
        return int(args.run(args) or 0)
    except BrokenPipeError:  # output piped into head & co.
        silence_stdout()
        return EXIT_OK
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every error becomes one line
        if os.environ.get("PTDSTREAM_DEBUG") and not isinstance(e, EXPECTED_ERRORS):
            raise
        code, message = exit_for(e, args.command)
        print_error(message)
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
