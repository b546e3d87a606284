"""``ptdstream verify``: byte identity with a reference, structure, or a manifest."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .common import EXIT_INVALID, EXIT_OK, UsageError, add_command, print_error, print_report, progress_wanted

__all__ = ["register", "run"]

if TYPE_CHECKING:  # imported in _check, by the check it runs
    from ..check.compare import CompareReport
    from ..check.manifest import ManifestReport
    from ..check.structure import StructureReport


def register(subparsers) -> None:
    """Add ``verify`` to ``subparsers``."""
    v = add_command(
        subparsers, "verify",
        help="compare with a reference, or check the structure of a .pte and its .ptd files",
        description="With --against: compare FILE with REF byte for byte (streamed) and name the first "
                    "difference. Without: check FILE (a .pte) and the .ptd files after it the way the "
                    "runtime loads them, including that every external tensor is in a given .ptd.",
        examples=[("ptdstream verify out/model.pte --against ref/model.pte", "byte identity with a reference"),
                  ("ptdstream verify model.pte model.ptd", "what the runtime checks when it loads them"),
                  ("ptdstream verify model.pte model.ptd --json", "the same, as JSON"),
                  ("ptdstream verify copy/model.pte copy/model.ptd --manifest model.manifest",
                   "a copy against a manifest, at disk speed"),
                  ("cat model.pte | ptdstream verify -", "a program from stdin")],
        exit_codes="exit codes: 0 valid or identical, 1 invalid, different or an unrecovered set in the folder, "
                   "2 usage error or unreadable input",
        run=run, progress=True, stdin=("files", "against"),
        inputs=lambda a: a.files + [p for p in (a.against, a.manifest) if p])
    v.add_argument("files", nargs="+", metavar="FILE", help="OUT (with --against), or OUT.pte [DATA.ptd ...]")
    v.add_argument("--against", metavar="REF", help="reference file to compare the single FILE with")
    v.add_argument("--manifest", metavar="M", help="check each FILE against manifest M (piece digests)")


def unrecovered_sets(files):
    """The unrecovered set publications (journals) in the folders of ``files`` and
    where a save wrote their journal: beside the file a symlink names, resolved as
    the writer resolves it (:func:`ptdstream.write.sink.resolve_target`)."""
    from ..write.journal import unrecovered
    from ..write.sink import resolve_target

    folders = sorted({os.path.dirname(p) for f in files
                      for p in (os.path.abspath(f), resolve_target(os.path.abspath(f)))})
    return [p for folder in folders for p in unrecovered(folder)]


def run(args) -> int:
    pending = unrecovered_sets(args.files)
    for p in pending:  # the files may be a mix of two saves until the set is completed
        names = ", ".join(os.path.basename(t) for t in p.targets) or "unreadable journal"
        print_error(f"ptdstream verify: unrecovered set in {os.path.dirname(p.path)} ({names}; journal "
                    f"{os.path.basename(p.path)}): run `ptdstream recover {os.path.dirname(p.path)}`")
    code = _check(args)
    return EXIT_INVALID if pending else code


def _check(args) -> int:
    report: ManifestReport | CompareReport | StructureReport
    if args.manifest is not None:
        if args.against is not None:
            raise UsageError("ptdstream verify: use either --against or --manifest (see ptdstream verify --help)")
        from ..check.manifest import verify_files

        report = verify_files(args.files, args.manifest)
    elif args.against is not None:
        if len(args.files) != 1:
            raise UsageError(f"ptdstream verify: --against compares one FILE, got {len(args.files)} "
                             "(see ptdstream verify --help)")
        from ..check.compare import compare_files

        report = compare_files(args.files[0], args.against, progress=progress_wanted(args))
    else:
        from ..check.structure import check_structure

        report = check_structure(args.files[0], args.files[1:])
    print_report(args, report)
    return EXIT_OK if report.ok else EXIT_INVALID
