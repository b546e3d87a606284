"""``ptdstream recover``: complete set publications a killed save left half done."""

from __future__ import annotations

import os

from ..system.files import files_of
from .common import EXIT_INVALID, EXIT_OK, add_command, print_error, print_json
from .errors import UsageError

__all__ = ["register", "run"]


def register(subparsers) -> None:
    """Add ``recover`` to ``subparsers``."""
    r = add_command(
        subparsers, "recover",
        help="complete a set of files a killed save left half published",
        description="A save publishes its .pte, .ptd files and manifest as one set under a journal. A process "
                    "killed while publishing leaves the journal; the next ptdstream writer into the folder "
                    "completes it, and so does this command: forward to the whole new set when every new file "
                    "is on disk, else back to the whole old set. Leftover temp files of dead writers are removed; "
                    "files of saves still running are not touched (it waits for a publication in progress). "
                    "A file of DIR that is a symlink was saved beside the file it names: that folder is "
                    "recovered too.",
        examples=[("ptdstream recover out/", "complete or roll back the set in out/"),
                  ("ptdstream recover out/ --json", "what was done, as JSON")],
        exit_codes="exit codes: 0 recovered or nothing to do, 1 a journal could not be completed or was refused "
                   "(it names files outside its folder, is unreadable, or another program changed its files: "
                   "it and every file are left in place), 2 usage error",
        run=run, inputs=lambda a: [f for folder in a.folders if os.path.isdir(folder) for f in files_of(folder)])
    r.add_argument("folders", nargs="+", metavar="DIR", help="folder of a saved set")


def run(args) -> int:
    """``ptdstream recover``: complete or roll back the half-published sets of each folder."""
    from ..write.journal import RecoveryError, recover

    for folder in args.folders:  # before touching any: a typo must not read as "all well"
        if not os.path.isdir(folder):
            what = "no such folder" if not os.path.exists(folder) else "not a folder (give the folder of the set)"
            raise UsageError(f"ptdstream recover: {folder}: {what}")
    done, failed = [], []
    for folder in _with_link_folders(args.folders):
        try:
            done += [{"folder": folder, "journal": j, "direction": d} for j, d in recover(folder)]
        except RecoveryError as e:
            failed.append({"folder": folder, "error": str(e)})
    if args.json:
        print_json(args, {"ok": not failed, "recovered": done, "failed": failed})
    elif not args.quiet:
        for d in done:
            way = "forward (the new set)" if d["direction"] == "forward" else "back (the old set)"
            print(f"{d['folder']}: completed {d['journal']}: rolled {way}")
        if not done and not failed:
            print(f"nothing to recover in {', '.join(args.folders)}")
    for f in failed:
        print_error(f"ptdstream recover: {f['error']}")
    return EXIT_INVALID if failed else EXIT_OK


def _with_link_folders(folders):
    """``folders`` and, after each, the folders its symlinks point into (where a save
    through the link wrote its journal, resolved as the writer resolves it)."""
    from ..write.folder import resolve_target

    out = []
    for folder in folders:
        found = [folder]
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            names = []
        for name in names:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                linked = os.path.dirname(resolve_target(os.path.abspath(path)))
                if os.path.isdir(linked):
                    found.append(linked)
        for f in found:
            if all(not _same(f, seen) for seen in out):
                out.append(f)
    return out


def _same(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
