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
                    "A journal is proof only of what ptdstream wrote: one of another user, writable by others, "
                    "or whose files do not carry its save's mark is refused and every file left in place. "
                    "Only DIR is recovered (and the other folders a journal of DIR names as part of its set): "
                    "a symlink of DIR into another folder is not followed unless --follow-links is given; a "
                    "pending journal found behind one is named, exit 1.",
        examples=[("ptdstream recover out/", "complete or roll back the set in out/"),
                  ("ptdstream recover out/ --json", "what was done, as JSON"),
                  ("ptdstream recover --follow-links links/",
                   "also recover the folders links/'s symlinks point into (a set saved through the links)")],
        exit_codes="exit codes: 0 recovered or nothing to do, 1 a journal could not be completed or was refused "
                   "(it names files outside its folder, is unreadable, another user's or writable by others, "
                   "another program changed its files, or they carry no mark of its save: it and every file are "
                   "left in place), or a symlink of DIR points into a folder holding a pending journal that was "
                   "not recovered (without --follow-links), 2 usage error",
        run=run, inputs=lambda a: [f for folder in a.folders if os.path.isdir(folder) for f in files_of(folder)])
    r.add_argument("folders", nargs="+", metavar="DIR", help="folder of a saved set")
    r.add_argument("--follow-links", action="store_true",
                   help="also recover every folder a symlink of DIR points into (its journals, backups and dead "
                        "writers' temp files), as a save through the link would")


def run(args) -> int:
    """``ptdstream recover``: complete or roll back the half-published sets of each folder."""
    from ..write.journal import RecoveryError, recover

    for folder in args.folders:  # before touching any: a typo must not read as "all well"
        if not os.path.isdir(folder):
            what = "no such folder" if not os.path.exists(folder) else "not a folder (give the folder of the set)"
            raise UsageError(f"ptdstream recover: {folder}: {what}")
    done, failed = [], []
    folders = _with_link_folders(args.folders) if args.follow_links else _distinct(args.folders)
    for folder in folders:
        try:
            done += [{"folder": folder, "journal": j, "direction": d} for j, d in recover(folder)]
        except RecoveryError as e:
            failed.append({"folder": folder, "error": str(e)})
    behind = [] if args.follow_links else _pending_behind_links(args.folders)
    if args.json:
        print_json(args, {"ok": not failed and not behind, "recovered": done, "failed": failed,
                          "not_followed": behind})
    elif not args.quiet:
        for d in done:
            way = "forward (the new set)" if d["direction"] == "forward" else "back (the old set)"
            print(f"{d['folder']}: completed {d['journal']}: rolled {way}")
        if not done and not failed and not behind:
            print(f"nothing to recover in {', '.join(args.folders)}")
    for f in failed:
        print_error(f"ptdstream recover: {f['error']}")
    for b in behind:
        journals = ", ".join(os.path.basename(j) for j in b["journals"])
        print_error(f"ptdstream recover: {b['link']} links into {b['folder']}, which holds a pending journal "
                    f"({journals}): not recovered, no journal of {b['from']} records a save through the link; "
                    f"run `ptdstream recover {b['folder']}`, or `ptdstream recover --follow-links {b['from']}`")
    return EXIT_INVALID if failed or behind else EXIT_OK


def _links(folder):
    """``[(link path, folder its file lies in)]`` for each symlink of ``folder`` to
    a file (or to nothing yet: a target a save writes through) in an existing
    folder, resolved as the writer resolves a target; a link to a folder is no
    target and is skipped, and so is one the writer refuses to follow (another
    user's link in a sticky folder, a loop: :func:`ptdstream.write.folder.resolve_target`)."""
    from ..write.folder import resolve_target

    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    out = []
    for name in names:
        path = os.path.join(folder, name)
        if os.path.islink(path) and not os.path.isdir(path):
            try:
                linked = os.path.dirname(resolve_target(os.path.abspath(path)))
            except OSError:
                continue
            if os.path.isdir(linked):
                out.append((path, linked))
    return out


def _distinct(folders):
    out = []
    for f in folders:
        if all(not _same(f, seen) for seen in out):
            out.append(f)
    return out


def _with_link_folders(folders):
    """``folders`` and, after each, the folders its symlinks point into (where a save
    through the link wrote its journal): ``--follow-links``."""
    return _distinct([f for folder in folders for f in [folder] + [linked for _, linked in _links(folder)]])


def _pending_behind_links(folders):
    """The folders (not given) that symlinks of ``folders`` point into and that hold
    a journal, listed by name only: nothing there is read, locked or touched."""
    from ..write.tempfiles import temp_files_in

    out = []
    for folder in folders:
        for link, linked in _links(folder):
            if any(_same(linked, f) for f in folders) or any(_same(linked, b["folder"]) for b in out):
                continue
            journals = [p for p, _, suffix in temp_files_in(linked) if suffix == "journal"]
            if journals:
                out.append({"from": folder, "link": link, "folder": linked, "journals": journals})
    return out


def _same(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
