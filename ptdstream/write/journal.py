"""Publishing a set of files as one: a journal with roll-forward and roll-back.

A save publishes several files (the .ptd files, the .pte, a manifest). Renames
are atomic one file at a time only, so the set is published under a journal:

1. every file is written to a locked temp file beside its target and fsynced;
2. under the folders' locks, each existing target gets a hard-linked backup
   (``.bak``) and the folders are fsynced;
3. the journal (``.<last target>.ptdstream-<pid>-<hex>.journal``, format in
   :mod:`ptdstream.write.journal_codec`: each target, its temp file and backup as
   plain names of the journal's own folder, and the device, inode, size, change
   and modification time of each temp file and previous target) is written to a
   temp file, fsynced, renamed into place, and its folder fsynced: from here on
   the new set is committed. A set across folders has one journal per folder,
   the last folder's written last (:mod:`ptdstream.write.journal_peers`);
4. each temp file is renamed over its target, the folders fsynced;
5. the backups, then the journal, are removed.

A process killed anywhere leaves either no journal (the old set is whole; the
temp files and backups are leftovers, removed by the next writer) or a journal,
which :func:`recover` completes: when every entry's temp file is still there or
already renamed (its inode is at the target), it rolls forward (renames the rest);
otherwise (a temp file lost) it rolls back (puts each backup back, removes new
files that had none). A failed rename in a live process rolls back at once.

A journal is untrusted input, proof only of what ptdstream itself wrote: before
any file is touched it is refused, by name, when it is unreadable, too large or
too deep, another user's or writable by others, records another folder or
leaves a state out, names anything but files of its own folder of ptdstream's
shape (:func:`read_journal`), or when a target is not a regular file (a
directory, link, fifo or device) or a file it names is not the one it recorded
(another program wrote there after the kill:
:func:`ptdstream.write.journal_state.check_on_disk`), or when a file recovery
would move over a target, or replace or remove at a target's name, does not
carry the random mark its temp file got when it was created, recorded in the
journal (:func:`ptdstream.write.journal_state.check_proofs`; a file system
without extended attributes has no marks: such files are left as they are).
An ``OSError`` midway (a rename or fsync failing) is raised as a
:class:`RecoveryError` naming the journal, which stays: what was done is a state
recovery completes later. A journal that stays keeps every file it may own, and
refuses only saves of targets it may name, and only when it is the saving
user's own.

Recovery runs under the folder's lock, which a publisher holds from step 2 to
step 5, so a live publication is never recovered. Every ptdstream writer
recovers its folder before it writes (:func:`clean_folder`), and
:func:`recover` does it explicitly; :func:`unrecovered` lists what is pending.
Readers that do not recover first may see a mixed set while a journal is pending.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence

from ..errors import RecoveryError
from ..system import fsops
from . import tempfiles
from .journal_codec import JOURNAL_VERSION, FileState, Journal, JournalEntry, read_journal_file
from .journal_peers import set_journals
from .journal_state import backup_there, check_on_disk, check_proofs
from .journal_write import write_journal as _write_journal  # noqa: F401  (tests plant journals through it)
from .journal_write import write_journals as _write_journals

__all__ = ["JOURNAL_VERSION", "RecoveryError", "FileState", "JournalEntry", "PendingSet", "read_journal",
           "publish", "unrecovered", "recover", "recover_locked", "clean_folder"]


@dataclasses.dataclass(frozen=True)
class PendingSet:
    """An unrecovered journal: its ``path`` and the ``targets`` of its set
    (empty when the journal is unreadable or refused)."""

    path: str
    targets: tuple[str, ...]


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def read_journal(path: str) -> list[JournalEntry]:
    """The entries of the journal ``path`` (absolute paths), checked by
    :func:`ptdstream.write.journal_codec.read_journal_file`.

    Raises:
        RecoveryError: not a ptdstream journal of a known version, or one naming
            anything but files of its own folder of ptdstream's shape.
    """
    return list(read_journal_file(path).entries)


def _by_folder(entries: Sequence[JournalEntry]) -> list[list[JournalEntry]]:
    """``entries`` grouped by folder, in order of first appearance (one journal each)."""
    groups: dict[str, list[JournalEntry]] = {}
    for e in entries:
        groups.setdefault(os.path.dirname(e.target), []).append(e)
    return list(groups.values())


def _folders(entries: Sequence[JournalEntry]) -> list[str]:
    return sorted({os.path.dirname(e.target) for e in entries})


def publish(
    files: Sequence[tuple[str, str]],
    renames: Sequence[Callable[[], None]] | None = None,
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
    entries: list[JournalEntry] = []
    journals: list[str] = []
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
        groups = _by_folder(entries)  # a journal names only files of its own folder
        _write_journals(groups, journals)
    except BaseException:
        for path in journals:
            fsops.unlink(path)
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
            for path, group in zip(journals, groups, strict=True):
                _finish(path, group)
        except OSError:
            pass  # the journal stays; recover() finishes the roll-back later
        raise
    for path, group in zip(journals, groups, strict=True):
        _finish(path, group)


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
        if entry.backup is not None and backup_there(entry):
            # The backup is the previous file (a hard link made before the journal):
            # putting it back is right whether or not the new file got there.
            fsops.replace(entry.backup, entry.target)
        elif _identity(entry.target) == (entry.dev, entry.ino) and not entry.had_target:
            fsops.unlink(entry.target)
        if _identity(entry.temp) == (entry.dev, entry.ino):
            fsops.unlink(entry.temp)
    for folder in _folders(entries):
        fsops.fsync_dir(folder)


def _finish(journal: str, entries: Sequence[JournalEntry]) -> None:
    for entry in entries:
        if entry.backup is not None and backup_there(entry):  # not a file another user put at a freed backup name
            fsops.unlink(entry.backup)
    fsops.unlink(journal)
    fsops.fsync_dir(os.path.dirname(journal))


def _complete(journal: str) -> str:
    """Check the journal, its set's other journals and their files, roll the set
    forward or back in this folder, then remove the journal; ``"forward"`` or
    ``"back"``. Raises RecoveryError before touching a file.

    A main journal also completes the members whose folder lock it can take at
    once, and stays while a member journal is left; a member whose main journal
    is gone (never committed) rolls back."""
    checked = read_journal_file(journal)
    main, members = set_journals(checked)
    if main is None:
        check_on_disk(checked)
        check_proofs(checked, forward=False)
        _roll_back(checked.entries)
        _finish(journal, checked.entries)
        return "back"
    group = [main] + [m for m in members if m is not main]
    for g in group:
        check_on_disk(g)
    forward = all(
        _identity(e.temp) == (e.dev, e.ino) or _identity(e.target) == (e.dev, e.ino)
        for g in group for e in g.entries
    )
    for g in group:
        check_proofs(g, forward)
    if checked is not main:
        _act(checked, forward)
        return "forward" if forward else "back"
    for member in group[1:]:
        with tempfiles.folder_lock_nowait(os.path.dirname(member.path)) as locked:
            if locked:
                _act(member, forward)
    _act(main, forward, keep_journal=any(os.path.lexists(m.path) for m in group[1:]))
    return "forward" if forward else "back"


def _act(checked: Journal, forward: bool, keep_journal: bool = False) -> None:
    if forward:
        _roll_forward(checked.entries)
    else:
        _roll_back(checked.entries)
    if keep_journal:  # a member is left: the main journal goes last
        for entry in checked.entries:
            if entry.backup is not None and backup_there(entry):
                fsops.unlink(entry.backup)
        return
    _finish(checked.path, checked.entries)


def _journals(folder: str) -> list[str]:
    return [p for p, _, suffix in tempfiles.temp_files_in(folder) if suffix == "journal"]


def unrecovered(folder: str) -> list[PendingSet]:
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


class _Claims:
    """What the journals that stay in a folder may own, the folder listed once (another
    user's thousands of planted journals must not make each save scan it once per
    journal). A journal read: its temp and backup files; an unreadable or refused one:
    every temp and backup file of its own name's stem and of each stem its writer (same
    pid in the name) left, but for a live writer's temp files."""

    def __init__(self, folder: str) -> None:
        self._by_pid: dict[str | None, list[tuple[str, str, str]]] = {}
        for path, stem, suffix in tempfiles.temp_files_in(folder):
            if suffix != "journal":
                self._by_pid.setdefault(tempfiles.pid_of(os.path.basename(path)), []).append((path, stem, suffix))
        self._pid_stems: dict[str | None, frozenset[str]] = {}
        self.stems: set[str] = set()
        self.paths: set[str] = set()

    def _of_pid(self, pid: str | None) -> frozenset[str]:
        """The stems writer ``pid`` left (each pid's files are looked at once)."""
        if pid not in self._pid_stems:
            self._pid_stems[pid] = frozenset(stem for path, stem, suffix in self._by_pid.get(pid, ())
                                             if not (suffix == "tmp" and tempfiles.is_locked(path)))
            self.stems |= self._pid_stems[pid]
        return self._pid_stems[pid]

    def add(self, journal: str, named: bool = False) -> set[str]:
        """Claim what ``journal`` may own; returns the stems of the targets it may name
        when ``named`` (building them costs a pass over its writer's stems), else ``set()``."""
        try:
            entries = read_journal(journal)
        except RecoveryError:
            parsed = tempfiles.parse_name(os.path.basename(journal))
            own = {parsed[0]} if parsed else set()
            self.stems |= own
            of_pid = self._of_pid(tempfiles.pid_of(os.path.basename(journal)))
            return own | of_pid if named else set()
        self.paths.update(p for e in entries for p in (e.temp, e.backup) if p is not None)
        return {tempfiles.stem(os.path.basename(e.target)) for e in entries} if named else set()

    def keeps(self, path: str, stem: str) -> bool:
        """Whether a journal that stays may own the temp or backup file ``path`` (of ``stem``)."""
        return path in self.paths or stem in self.stems


def recover_locked(folder: str, targets: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """:func:`recover` for a caller that already holds ``folder``'s lock.

    ``targets``: the files a save is about to write (any folders); when given, a
    journal that cannot be completed raises only if it may name one of them (the
    save of unrelated files goes on beside it) and is owned by this process's
    effective uid (another user's journal, planted or not, stops no save of this
    user); ``None``: any such journal raises.

    Raises:
        RecoveryError: a journal that is unreadable, refused or cannot be completed
            (left in place with its files; the other journals are still completed).
    """
    folder = os.path.abspath(folder or ".")
    done = []
    errors: list[tuple[str, str]] = []
    for journal in _journals(folder):
        try:
            done.append((journal, _complete(journal)))
        except RecoveryError as e:
            errors.append((journal, str(e)))
        except OSError as e:  # midway: what is done is consistent, the journal stays to finish it
            errors.append((journal, f"journal {journal}: recovery stopped by {type(e).__name__}: {e}; the "
                                    f"journal stays with the files it names, completed up to there; fix the "
                                    f"cause, then run recover on {folder} again"))
    if targets is not None:
        mine = {}
        for target in targets:
            target = os.path.abspath(target)
            if os.path.dirname(target) == folder:
                mine[tempfiles.stem(os.path.basename(target))] = target
        blocking = []
        claims = _Claims(folder)
        for journal, message in errors:
            if not _own(journal):
                continue  # another user's: it acts on nothing of this user's, and stops no save of theirs
            named = sorted(mine[s] for s in claims.add(journal, named=True) if s in mine)
            if named:
                blocking.append((journal, f"{', '.join(named)} not written (a pending journal may name it; "
                                          f"recover or remove it, then save again): {message}"))
        errors = blocking
    if errors:
        raise RecoveryError("; ".join(m for _, m in errors))
    return done


def _own(path: str) -> bool:
    """Whether ``path`` is a file owned by this process's effective uid (not following a link)."""
    try:
        return os.lstat(path).st_uid == os.geteuid()
    except OSError:
        return False


def recover(folder: str) -> list[tuple[str, str]]:
    """Complete every pending set publication in ``folder`` and remove the
    leftovers of dead writers (:func:`clean_folder`); returns
    ``[(journal path, "forward" or "back")]``.

    Waits for a publication in progress in another process (its folder lock).

    Raises:
        RecoveryError: a journal that is unreadable, another user's or writable
            by others, names files outside its folder or not of ptdstream's
            shape, a target that is not a regular file, or whose files another
            program changed since it was written or carry no mark of its save
            (compared before any file is touched:
            :func:`ptdstream.write.journal_state.check_on_disk`,
            :func:`~ptdstream.write.journal_state.check_proofs`); it and every
            file it may name are left in place; the other journals are still
            completed. Or an ``OSError`` midway, naming the journal: it stays,
            to be completed by a later recovery.
    """
    return clean_folder(folder)


def clean_folder(folder: str, targets: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """The one cleanup every ptdstream writer runs before writing into ``folder``.

    Under the folder's lock: completes pending journals (:func:`recover_locked`,
    ``targets`` as there), then removes backups no journal may own and ``.tmp``
    files whose writer's lock is free (killed writers, in any PID namespace),
    owned by this process's effective uid (another user's are left to that user).
    Live writers' files are never touched, nor any file a journal that stays
    (unreadable, refused, or not completed) may own. Returns what :func:`recover` returns.

    Raises:
        RecoveryError: as :func:`recover_locked` (the stale files are still removed).
    """
    folder = os.path.abspath(folder or ".")
    with tempfiles.folder_lock([folder]):
        error = None
        try:
            done = recover_locked(folder, targets)
        except RecoveryError as e:
            error, done = e, []
        keep = _Claims(folder)
        for pending in _journals(folder):  # journals that stay: keep every file they may own
            keep.add(pending)
        for path, stem, suffix in tempfiles.temp_files_in(folder):
            if keep.keeps(path, stem) or suffix == "journal" or not _own(path):
                continue
            if suffix == "bak":
                fsops.unlink(path)
            else:
                tempfiles.remove_if_unlocked(path)
    if error is not None:
        raise error
    return done
