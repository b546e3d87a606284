"""``ptdstream verify``: byte identity with a reference, structure, or a manifest."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from ..check.runtime.kernels import parse_libraries
from ..errors import LayoutError
from ..system.files import open_input
from .common import EXIT_INVALID, EXIT_OK, STDIN_NAME, add_command, print_error, print_report, progress_wanted
from .errors import UsageError

__all__ = ["INTEGRITY_HINT", "check", "register", "run"]

#: The libraries ``--kernels`` takes, for ``--help``.
_LIBRARIES_HELP = ("portable (the runtime's own operators and the portable kernels), optimized (linked into "
                   "executorch's Python runtime), quantized (import executorch.kernels.quantized), llm (LLM custom "
                   "ops, llama::custom_sdpa, llama::update_cache...: import "
                   "executorch.extension.llm.custom_ops.custom_ops)")

#: Printed on stderr after a structure-only verify (not with -q).
INTEGRITY_HINT = ("ptdstream verify: structure checked, not the bytes (a changed weight or delegate byte passes, as "
                  "it loads in the runtime); --against REF or --manifest M proves the bytes")


def _libraries(text: str) -> tuple[str, ...]:
    try:
        return parse_libraries(text)
    except LayoutError as e:
        raise argparse.ArgumentTypeError(str(e)) from None

if TYPE_CHECKING:  # imported in _check, by the check it runs
    from ..check.compare import CompareReport
    from ..check.structure import StructureReport
    from ..manifest.verify import ManifestReport


def register(subparsers) -> None:
    """Add ``verify`` to ``subparsers``."""
    v = add_command(
        subparsers, "verify",
        help="compare with a reference, or check the structure of a .pte and its .ptd files",
        description="With --against: compare FILE with REF byte for byte (streamed) and name the first "
                    "difference. With --manifest: check each FILE against the piece digests of a manifest. "
                    "Without either: check FILE (a .pte) and the .ptd files after it the way the runtime "
                    "loads them, including that every external tensor is in a given .ptd and that every "
                    "operator is in a kernel library shipped with executorch (--kernels restricts them; the "
                    "report names the libraries the program needs), for the loader you have (--loader): "
                    "executorch.runtime's load_program takes one .ptd, so a program whose keys are spread "
                    "over several fails naming the keys each file lacks, unless --loader module (the C++ Module "
                    "given several data files).\n\n"
                    "Structure is not integrity: the structure checks are what the runtime checks when it "
                    "loads the program, so a changed byte inside a weight or a delegate blob still passes "
                    "them (the runtime would run it too). --against REF or --manifest M prove the bytes.",
        examples=[("ptdstream verify out/model.pte --against ref/model.pte", "byte identity with a reference"),
                  ("ptdstream verify model.pte model.ptd", "what the runtime checks when it loads them"),
                  ("ptdstream verify model.pte model.ptd --json", "the same, as JSON"),
                  ("ptdstream verify copy/model.pte copy/model.ptd --manifest model.manifest",
                   "a copy against a manifest, at disk speed"),
                  ("ptdstream verify model.pte --kernels portable,optimized", "refuse operators of other "
                   "kernel libraries"),
                  ("ptdstream verify model.pte a.ptd b.ptd --loader module", "for the C++ Module given both "
                   "data files (executorch.runtime takes one)"),
                  ("cat model.pte | ptdstream verify -", "a program from stdin")],
        exit_codes=f"kernel libraries (--kernels): {_LIBRARIES_HELP}\n"
                   "exit codes: 0 valid or identical, 1 invalid, different, an operator outside --kernels or an "
                   "unrecovered set in the folder, or keys the loader cannot find (--loader runtime: in more "
                   "than one .ptd), 2 usage error or unreadable input",
        run=run, progress=True, stdin=("files", "against"),
        inputs=lambda a: a.files + [p for p in (a.against, a.manifest) if p], check=check)
    v.add_argument("files", nargs="+", metavar="FILE", help="OUT (with --against), or OUT.pte [DATA.ptd ...]")
    v.add_argument("--against", metavar="REF", help="reference file to compare the single FILE with")
    v.add_argument("--manifest", metavar="M", help="check each FILE against manifest M (piece digests)")
    v.add_argument("--kernels", metavar="LIB[,LIB...]", type=_libraries,
                   help="the kernel libraries the runtime has (default: every one shipped with executorch); "
                        "an operator outside them fails the check, naming its library")
    v.add_argument("--loader", choices=("runtime", "module"), default=None,
                   help="the loader the structure check answers for: runtime (default: executorch.runtime's "
                        "load_program, one .ptd) or module (the C++ Module given several .ptd files)")


def unrecovered_sets(files):
    """The unrecovered set publications (journals) in the folders of ``files`` and
    where a save wrote their journal: beside the file a symlink names, resolved as
    the writer resolves it (:func:`ptdstream.write.folder.resolve_target`)."""
    from ..write.folder import resolve_target
    from ..write.journal import unrecovered

    def written(path):  # a link the writer refuses (another user's, a loop) had nothing written through it
        try:
            return resolve_target(path)
        except OSError:
            return path

    folders = sorted({os.path.dirname(p) for f in files
                      for p in (os.path.abspath(f), written(os.path.abspath(f)))})
    return [p for folder in folders for p in unrecovered(folder)]


def run(args) -> int:
    """``ptdstream verify``: the exit code of the check ``args`` pick (an unrecovered set in a folder makes it
    invalid)."""
    pending = unrecovered_sets(args.files)
    for p in pending:  # the files may be a mix of two saves until the set is completed
        names = ", ".join(os.path.basename(t) for t in p.targets) or "unreadable journal"
        print_error(f"ptdstream verify: unrecovered set in {os.path.dirname(p.path)} ({names}; journal "
                    f"{os.path.basename(p.path)}): run `ptdstream recover {os.path.dirname(p.path)}`")
    code = _check(args)
    return EXIT_INVALID if pending else code


def check(args) -> None:
    """The options and the kinds of the files, before anything is imported.

    Raises:
        UsageError: ``--kernels`` or ``--loader`` with ``--against`` or ``--manifest``; both of
            those; ``--against`` with more than one FILE; a structure check whose
            first FILE is a .ptd (:func:`_refuse_data_first`).
    """
    for flag, value in (("--kernels", args.kernels), ("--loader", args.loader)):
        if value is not None and (args.manifest is not None or args.against is not None):
            raise UsageError(f"ptdstream verify: {flag} is for the structure check, not with --against or "
                             "--manifest (see ptdstream verify --help)")
    if args.manifest is not None and args.against is not None:
        raise UsageError("ptdstream verify: use either --against or --manifest (see ptdstream verify --help)")
    if args.against is not None and len(args.files) != 1:
        raise UsageError(f"ptdstream verify: --against compares one FILE, got {len(args.files)} "
                         "(see ptdstream verify --help)")
    if args.against is None and args.manifest is None:
        _refuse_data_first(args)


def _check(args) -> int:
    report: ManifestReport | CompareReport | StructureReport
    if args.manifest is not None:
        from ..manifest.verify import verify_files

        report = verify_files(args.files, args.manifest)
    elif args.against is not None:
        from ..check.compare import compare_files

        report = compare_files(args.files[0], args.against, progress=progress_wanted(args))
    else:
        from ..check.structure import check_structure

        report = check_structure(args.files[0], args.files[1:], kernels=args.kernels, loader=args.loader or "runtime")
    print_report(args, report)
    if not report.ok and args.quiet:
        print_error(_failure_line(report, args))
    if args.against is None and args.manifest is None and not args.quiet:
        print_error(INTEGRITY_HINT)
    return EXIT_OK if report.ok else EXIT_INVALID


def _kind(path: str) -> str | None:
    """``"pte"`` or ``"ptd"`` from a file's identifier (bytes 4..8), else None (the
    structure check reports what is wrong with it)."""
    from ..format.identity import kind_of

    try:
        with open_input(path) as f:
            return kind_of(f.read(8)[4:])
    except OSError:
        return None


def _refuse_data_first(args) -> None:
    """The structure check reads a program first, then its data files.

    Raises:
        UsageError: the first FILE is a .ptd (FlatTensor data), naming it and the
            command line to run: the .pte first (one of the other FILEs if one
            is, else ``MODEL.pte``), or ``--against`` / ``--manifest`` for the
            .ptd alone.
    """
    import shlex

    if _kind(args.files[0]) != "ptd":
        return
    spool = getattr(args, "stdin_spool", None)
    shown = ["-" if f == spool else f for f in args.files]
    programs = [i for i, f in enumerate(args.files[1:], 1) if _kind(f) == "pte"]
    program = shown[programs[0]] if programs else "MODEL.pte"
    data = [f for i, f in enumerate(shown) if not programs or i != programs[0]]
    line = " ".join(shlex.quote(f) if f != "MODEL.pte" else f for f in ["ptdstream", "verify", program, *data])
    first = STDIN_NAME if args.files[0] == spool else args.files[0]  # as reports and errors name stdin
    raise UsageError(f"ptdstream verify: {first} is a .ptd (FlatTensor data), not a program: the structure check "
                     f"needs the .pte first, then its .ptd files: {line} (a .ptd alone: --against REF or "
                     "--manifest M)")


def _failure_line(report, args) -> str:
    """The one line ``-q`` prints for a failed check: the first problem and how many there are."""
    from ..check.structure import StructureReport

    if isinstance(report, StructureReport):
        first, n = report.problems[0], len(report.problems)
        line = f"INVALID {first.path}: {first.name}: {first.detail}"
    elif args.manifest is not None:
        bad = [c for c in report.checks if not c.ok]
        first, n = bad[0], len(bad)
        line = first.summary()
    else:
        line, n = report.summary(), 1
    more = f" (and {n - 1} more failed check{'s' * (n != 2)})" if n > 1 else ""
    spool = getattr(args, "stdin_spool", None)
    return f"ptdstream verify: {line.replace(spool, STDIN_NAME) if spool else line}{more}"
