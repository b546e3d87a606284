"""Publishing a set of files as one: a journal with roll-forward and roll-back.

A save publishes several files (the .ptd files, the .pte, a manifest). Renames
are atomic one file at a time only, so the set is published under a journal:

1. every file is written to a locked temp file beside its target and fsynced;
2. under the folders' locks, each existing target gets a hard-linked backup
   (``.bak``) and the folders are fsynced;
3. the journal (``.<last target>.ptdstream-<pid>-<hex>.journal``, JSON: each
   target, its temp file and backup as paths relative to the journal's folder,
   so that a moved or copied folder recovers itself and nothing else, and the
   temp file's device and inode) is
   written to a temp file, fsynced, renamed into place, and its folder fsynced:
   from here on the new set is committed;
4. each temp file is renamed over its target, the folders fsynced;
5. the backups, then the journal, are removed.

A process killed anywhere leaves either no journal (the old set is whole; the
temp files and backups are leftovers, removed by the next writer) or a journal,
which :func:`recover` completes: when every entry's temp file is still there or
already renamed (its inode is at the target), it rolls forward (renames the rest);
otherwise (a temp file lost, or a copied folder, where no inode matches) it
rolls back (puts each backup back, removes new files that had none). A failed
rename in a live process rolls back at once.

Recovery runs under the folder's lock, which a publisher holds from step 2 to
step 5, so a live publication is never recovered. Every ptdstream writer
recovers its folder before it writes (:func:`clean_folder`), and
:func:`recover` does it explicitly; :func:`unrecovered` lists what is pending.
Readers that do not recover first may see a mixed set while a journal is pending.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from ..errors import PtdstreamError
from ..system import fsops
from . import tempfiles

__all__ = ["JournalEntry", "PendingSet", "RecoveryError", "clean_folder", "publish", "recover",
           "recover_locked", "unrecovered"]

#: 2: paths relative to the journal's folder (1: absolute paths, still read).
JOURNAL_VERSION = 2


class RecoveryError(PtdstreamError):
    """A journal that cannot be completed in either direction (unreadable, or its
    files changed by another program); it is left in place, named in the message."""


@dataclass(frozen=True)
class JournalEntry:
    """One file of a set: ``target`` (absolute path), ``temp`` (its synced temp
    file), ``backup`` (hard link to the previous target, or ``None`` when there was
    none or links are unsupported), ``had_target`` and the temp file's ``dev``/``ino``."""

    target: str
    temp: str
    backup: Optional[str]
    had_target: bool
    dev: int
    ino: int


@dataclass(frozen=True)
class PendingSet:
    """An unrecovered journal: its ``path`` and the ``targets`` of its set."""

    path: str
    targets: Tuple[str, ...]


def _identity(path: str) -> Optional[Tuple[int, int]]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


_PATH_FIELDS = ("target", "temp", "backup")


def _dump(entries: Sequence[JournalEntry], folder: str) -> bytes:
    """The journal's JSON, paths relative to ``folder`` (the journal's own)."""
    rows = []
    for e in entries:
        row = dict(e.__dict__)
        for name in _PATH_FIELDS:
            if row[name] is not None:
                row[name] = os.path.relpath(row[name], folder)
        rows.append(row)
    return json.dumps({"ptdstream_journal": JOURNAL_VERSION, "entries": rows}, sort_keys=True).encode()


def read_journal(path: str) -> List[JournalEntry]:
    """The entries of the journal ``path``.

    Raises:
        RecoveryError: it is not a ptdstream journal of a known version.
    """
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(16 << 20))
        version = data.get("ptdstream_journal")
        if version not in (1, JOURNAL_VERSION):
            raise ValueError(f"version {version!r}")
        folder = os.path.dirname(os.path.abspath(path))
        entries = []
        for row in data["entries"]:
            if version >= 2:  # relative to where the journal is now, not where it was written
                row = dict(row, **{k: os.path.normpath(os.path.join(folder, row[k]))
                                   for k in _PATH_FIELDS if row[k] is not None})
            entries.append(JournalEntry(**row))
        return entries
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise RecoveryError(f"journal {path}: unreadable ({type(e).__name__}: {e}); left in place") from None


def _write_journal(path_for: str, entries: Sequence[JournalEntry]) -> str:
    """Write, fsync and rename a journal into place beside ``path_for``; its path."""
    temp, fd, lock_fd = tempfiles.create_locked(path_for, "tmp", 0o644)
    try:
        try:
            view = memoryview(_dump(entries, os.path.dirname(os.path.abspath(path_for))))
            while view:
                view = view[os.write(fd, view):]
            fsops.fsync(fd, temp)
        finally:
            os.close(fd)
        final = temp[: -len(".tmp")] + ".journal"
        fsops.replace(temp, final)
    except BaseException:
        fsops.unlink(temp)
        raise
    finally:
        os.close(lock_fd)
    fsops.fsync_dir(os.path.dirname(final))
    return final


def _folders(entries: Sequence[JournalEntry]) -> List[str]:
    return sorted({os.path.dirname(e.target) for e in entries})


def publish(
    files: Sequence[Tuple[str, str]],
    renames: Optional[Sequence[Callable[[], None]]] = None,
) -> None:
    """Publish ``[(temp, target)]`` (synced temp files, in publish order) as one set.

    The caller holds the lock of every target folder (:func:`tempfiles.folder_lock`)
    and keeps each temp file's lock until this returns. A single file is renamed
    without a journal (one rename is atomic). ``renames``: one callable per file
    that renames its temp file over its target (a sink's ``publish``); by default
    :func:`fsops.replace` then a folder fsync.

    Raises:
        OSError: a link, rename or fsync failed; the previous set was put back
            first (and the journal removed), or, where even that failed, the
            journal stays for :func:`recover`.
    """
    if renames is None:
        renames = [functools.partial(_rename, t, d) for t, d in files]
    if len(files) == 0:  # e.g. write_tensor_data_to_file of a program without data files
        return
    if len(files) == 1:
        renames[0]()
        return
    entries: List[JournalEntry] = []
    try:
        for temp, target in files:
            target = os.path.abspath(target)
            had = os.path.lexists(target)
            backup = None
            if had and not os.path.islink(target):
                backup = tempfiles.temp_name_for(target, "bak")
                try:
                    fsops.link(target, backup)
                except OSError:
                    backup = None  # no hard links here: a crash can still roll forward
            st = os.lstat(temp)
            entries.append(JournalEntry(target, os.path.abspath(temp), backup, had, st.st_dev, st.st_ino))
        for folder in _folders(entries):
            fsops.fsync_dir(folder)
        journal = _write_journal(entries[-1].target, entries)
    except BaseException:
        for entry in entries:
            if entry.backup is not None:
                fsops.unlink(entry.backup)
        raise
    try:
        for rename in renames:
            rename()
    except BaseException:
        try:
            _roll_back(entries)
            _finish(journal, entries)
        except OSError:
            pass  # the journal stays; recover() finishes the roll-back later
        raise
    _finish(journal, entries)


def _rename(temp: str, target: str) -> None:
    fsops.replace(temp, target)
    fsops.fsync_dir(os.path.dirname(target))


def _roll_forward(entries: Sequence[JournalEntry]) -> None:
    for entry in entries:
        if _identity(entry.temp) == (entry.dev, entry.ino):
            fsops.replace(entry.temp, entry.target)
    for folder in _folders(entries):
        fsops.fsync_dir(folder)


def _roll_back(entries: Sequence[JournalEntry]) -> None:
    for entry in reversed(entries):
        if entry.backup is not None and os.path.lexists(entry.backup):
            # The backup is the previous file (a hard link made before the journal):
            # putting it back is right whether or not the new file got there, and in
            # a copied folder, where no inode is the journal's, it is all we know.
            fsops.replace(entry.backup, entry.target)
        elif _identity(entry.target) == (entry.dev, entry.ino) and not entry.had_target:
            fsops.unlink(entry.target)
        if _identity(entry.temp) == (entry.dev, entry.ino):
            fsops.unlink(entry.temp)
    for folder in _folders(entries):
        fsops.fsync_dir(folder)


def _finish(journal: str, entries: Sequence[JournalEntry]) -> None:
    for entry in entries:
        if entry.backup is not None:
            fsops.unlink(entry.backup)
    fsops.unlink(journal)
    fsops.fsync_dir(os.path.dirname(journal))


def _complete(journal: str) -> str:
    """Roll the journal's set forward or back, then remove it; ``"forward"`` or ``"back"``."""
    entries = read_journal(journal)
    forward = all(
        _identity(e.temp) == (e.dev, e.ino) or _identity(e.target) == (e.dev, e.ino)
        for e in entries
    )
    if forward:
        _roll_forward(entries)
    else:
        _roll_back(entries)
    _finish(journal, entries)
    return "forward" if forward else "back"


def _journals(folder: str) -> List[str]:
    return [p for p, _, suffix in tempfiles.temp_files_in(folder) if suffix == "journal"]


def unrecovered(folder: str) -> List[PendingSet]:
    """The journals of ``folder`` whose set is not yet completed, with their
    targets (a publication in progress in a live process is listed too; take
    :func:`recover` to wait for it and complete the rest). Reads only."""
    pending = []
    for path in _journals(folder):
        try:
            targets = tuple(e.target for e in read_journal(path))
        except RecoveryError:
            targets = ()
        pending.append(PendingSet(path, targets))
    return pending


def recover_locked(folder: str) -> List[Tuple[str, str]]:
    """:func:`recover` for a caller that already holds ``folder``'s lock."""
    done = []
    errors = []
    for journal in _journals(folder):
        try:
            done.append((journal, _complete(journal)))
        except (RecoveryError, OSError) as e:
            errors.append(str(e))
    if errors:
        raise RecoveryError("; ".join(errors))
    return done


def recover(folder: str) -> List[Tuple[str, str]]:
    """Complete every pending set publication in ``folder`` and remove the
    leftovers of dead writers (:func:`clean_folder`); returns
    ``[(journal path, "forward" or "back")]``.

    Waits for a publication in progress in another process (its folder lock).

    Raises:
        RecoveryError: a journal that is unreadable or cannot be completed (left
            in place; the other journals are still completed).
    """
    return clean_folder(folder)


def clean_folder(folder: str) -> List[Tuple[str, str]]:
    """The one cleanup every ptdstream writer runs before writing into ``folder``.

    Under the folder's lock: completes pending journals (:func:`recover_locked`),
    then removes backups no journal refers to and ``.tmp`` files whose writer's
    lock is free (killed writers, in any PID namespace). Live writers' files are
    never touched. Returns what :func:`recover` returns.

    Raises:
        RecoveryError: as :func:`recover` (the stale files are still removed).
    """
    folder = os.path.abspath(folder or ".")
    with tempfiles.folder_lock([folder]):
        error = None
        try:
            done = recover_locked(folder)
        except RecoveryError as e:
            error, done = e, []
        keep = set()
        for pending in _journals(folder):  # unrecoverable ones: keep their files
            try:
                keep.update(e.backup for e in read_journal(pending) if e.backup)
                keep.update(e.temp for e in read_journal(pending))
            except RecoveryError:
                pass
        for path, _, suffix in tempfiles.temp_files_in(folder):
            if path in keep or suffix == "journal":
                continue
            if suffix == "bak":
                fsops.unlink(path)
            else:
                tempfiles.remove_if_unlocked(path)
    if error is not None:
        raise error
    return done
