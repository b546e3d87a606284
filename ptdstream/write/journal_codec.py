"""A set publication's journal file: its bytes, and reading them as untrusted input.

Version 4 (JSON, ASCII)::

    {"ptdstream_journal": 4, "folder": [dev, ino],
     "entries": [{"target": NAME, "temp": NAME, "backup": NAME or null,
                  "had_target": bool, "dev": int, "ino": int, "mark": MARK or null,
                  "new": STATE, "old": STATE or null}, ...],
     "main": REF or null, "members": [REF, ...]}

``NAME`` is a plain file name in the journal's own folder; ``temp`` and
``backup`` are the target's temp names (:func:`ptdstream.write.tempfiles.temp_name_for`,
suffixes ``tmp`` and ``bak``); ``dev``/``ino`` are the temp file's; ``MARK`` is
the random mark the temp file carries (:mod:`ptdstream.system.marks`; ``null``
where the file system took none); ``STATE`` is ``{"dev", "ino", "size",
"ctime_ns", "mtime_ns"}`` of the temp file (``new``, always) and of the previous
target (``old``: there exactly when ``had_target``), taken after the backup link;
``folder`` is the folder's device and inode. A set whose files lie in several
folders has one journal per folder: the last folder's (``main``) lists the others
(``members``), each member names the main one; ``REF`` is ``{"journal": path
relative to this journal's folder, "folder": [dev, ino]}``, a reference only,
acted on once both sides confirm it (:mod:`ptdstream.write.journal_peers`).
Versions 1 to 3 (no marks; 1 and 2 no states) are refused: they cannot prove
their files.

A journal is trusted only for the folder it lies in (SQLite's rule for a hot
journal) and only as far as it proves itself: :func:`read_journal_file` refuses,
before any file is touched, a journal that is not a regular file of at most
:data:`JOURNAL_MAX_NBYTES`, is not owned by this process's effective uid or is
writable by its group or others (a journal is the word of the user who saved,
nobody else's), nests deeper than the format (checked on the bytes, before
parsing), records another folder's device and inode than its own folder's (a
copy, or ``[0, 0]``), leaves a state out (``null`` where the format wants one,
so that nothing would be compared), or names anything but the shape ptdstream
writes: a plain name (no ``/``, NUL, ``.`` or ``..``), not itself a
temp/journal name, each target once, its temp and backup names derived from it
by the naming rule, the journal's own name derived from its last target.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import RecoveryError
from ..system.marks import MARK_RE
from . import tempfiles

__all__ = ["JOURNAL_VERSION", "JOURNAL_MAX_NBYTES", "FileState", "JournalEntry",
           "Journal", "dump_journal", "read_journal_file", "state_of"]

#: 4: plain names, the recorded state of every file and each temp file's mark
#: (3: no marks; 2: relative paths; 1: absolute).
JOURNAL_VERSION = 4
#: Largest journal read, in bytes (a set of 1,000 files with 255-byte names is well under).
JOURNAL_MAX_NBYTES = 1 << 20
#: Most entries (files of a set) a journal may hold.
JOURNAL_MAX_ENTRIES = 4096
_MAX_DEPTH = 4  # object > entries list > entry object > state object (> folder id of a member)
#: A JSON string, or an unterminated one to the end: every ``"`` matches, so the
#: scan is linear (a failed match would be retried from each later ``"``).
_STRING_RE = re.compile(rb'"(?:[^"\\]|\\.)*"|"[\s\S]*', re.DOTALL)
_BRACKETS_RE = re.compile(rb"[^\[\]{}]+")
_STATE_KEYS = ("dev", "ino", "size", "ctime_ns", "mtime_ns")


@dataclass(frozen=True)
class FileState:
    """What a file was when the journal was written: ``dev``, ``ino``, ``size``
    (bytes), ``ctime_ns`` and ``mtime_ns`` (nanoseconds)."""

    dev: int
    ino: int
    size: int
    ctime_ns: int
    mtime_ns: int


def state_of(path: str) -> FileState | None:
    """The :class:`FileState` of ``path`` (not following a link), or ``None`` when absent."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return FileState(st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns, st.st_mtime_ns)


@dataclass(frozen=True)
class JournalEntry:
    """One file of a set: ``target`` (absolute path), ``temp`` (its synced temp
    file), ``backup`` (hard link to the previous target, or ``None`` when there was
    none or links are unsupported), ``had_target``, the temp file's ``dev``/``ino``,
    what the temp file (``new``) and the previous target (``old``) were when the
    journal was written (``None`` before it is written; ``old`` also when there was
    no target), and the temp file's ``mark`` (``None``: the file system took none)."""

    target: str
    temp: str
    backup: str | None
    had_target: bool
    dev: int
    ino: int
    new: FileState | None = None
    old: FileState | None = None
    mark: str | None = None


@dataclass(frozen=True)
class Journal:
    """A journal read and checked: its ``path``, ``version``, its folder's
    ``(dev, ino)`` (the one it lies in), its ``entries``."""

    path: str
    version: int
    folder_id: tuple[int, int]
    entries: tuple[JournalEntry, ...]
    #: the main journal of a set across folders, for a member: (absolute path, its folder's (dev, ino))
    main: tuple[str, tuple[int, int]] | None = None
    #: the member journals, for the main journal of a set across folders
    members: tuple[tuple[str, tuple[int, int]], ...] = ()


Ref = tuple[str, tuple[int, int]]


def dump_journal(entries: Sequence[JournalEntry], folder_id: tuple[int, int], *, folder: str = "",
                 main: Ref | None = None, members: Sequence[Ref] = ()) -> bytes:
    """The version 4 bytes of ``entries`` (all in ``folder``, whose ``(dev, ino)``
    is ``folder_id``): names only; ``main``/``members``: ``(absolute journal path,
    its folder's (dev, ino))``, written relative to ``folder``."""
    rows = []
    for e in entries:
        rows.append({
            "target": os.path.basename(e.target), "temp": os.path.basename(e.temp),
            "backup": None if e.backup is None else os.path.basename(e.backup),
            "had_target": e.had_target, "dev": e.dev, "ino": e.ino, "mark": e.mark,
            "new": None if e.new is None else e.new.__dict__,
            "old": None if e.old is None else e.old.__dict__,
        })

    def ref(r: Ref) -> dict[str, Any]:
        return {"journal": os.path.relpath(r[0], folder), "folder": list(r[1])}

    return json.dumps({"ptdstream_journal": JOURNAL_VERSION, "folder": list(folder_id), "entries": rows,
                       "main": None if main is None else ref(main), "members": [ref(m) for m in members]},
                      sort_keys=True).encode("ascii")


class _Refused(Exception):
    pass


def _read_bytes(path: str) -> bytes:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise _Refused(f"unreadable ({type(e).__name__}: {e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused("unreadable (not a regular file)")
        _check_owner(st)
        if st.st_size > JOURNAL_MAX_NBYTES:
            raise _Refused(f"unreadable ({st.st_size} bytes, more than the {JOURNAL_MAX_NBYTES} a journal may hold)")
        chunks, left = [], JOURNAL_MAX_NBYTES + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise _Refused(f"unreadable ({type(e).__name__}: {e})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > JOURNAL_MAX_NBYTES:
        raise _Refused(f"unreadable (grew past {JOURNAL_MAX_NBYTES} bytes while read)")
    return data


def _check_owner(st: os.stat_result) -> None:
    """Refuse a journal another user wrote or could have written."""
    euid = os.geteuid()
    if st.st_uid != euid:
        raise _Refused(f"owned by uid {st.st_uid}, not by this process's effective uid {euid} (a journal is the "
                       f"word of the user whose save wrote it: run recover as uid {st.st_uid})")
    if st.st_mode & 0o022:
        raise _Refused(f"mode {stat.S_IMODE(st.st_mode):#o} lets its group or others write it (a journal "
                       f"ptdstream writes is 0o600)")


def _check_depth(data: bytes) -> None:
    """Refuse bytes nesting deeper than the format, without recursing."""
    depth = 0
    for ch in _BRACKETS_RE.sub(b"", _STRING_RE.sub(b"", data)):
        depth += 1 if ch in b"[{" else -1
        if depth > _MAX_DEPTH:
            raise _Refused(f"unreadable (nested deeper than the {_MAX_DEPTH} levels of a journal)")


def _parse(data: bytes) -> dict[str, Any]:
    _check_depth(data)

    def no_constant(name: str) -> None:
        raise ValueError(f"{name} is not allowed")

    try:
        doc = json.loads(data.decode("ascii"), parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, too many digits
        raise _Refused(f"unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict):
        raise _Refused(f"unreadable (a JSON {type(doc).__name__}, not an object)")
    return doc


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise _Refused(f"unreadable ({what} is {value!r}, not a non-negative integer)")
    return value


def _state(value: Any, what: str) -> FileState:
    if value is None:
        raise _Refused(f"{what} is null, not a file state (a journal must record what it would compare)")
    if not isinstance(value, dict) or sorted(value) != sorted(_STATE_KEYS):
        raise _Refused(f"unreadable ({what} is not a file state {{{', '.join(_STATE_KEYS)}}})")
    return FileState(*(_int(value[k], f"{what}.{k}") for k in _STATE_KEYS))


def _folder_id(value: Any, what: str) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise _Refused(f"unreadable ({what} is not [dev, ino])")
    return _int(value[0], f"{what} dev"), _int(value[1], f"{what} ino")


def _ref(value: Any, what: str, folder: str) -> Ref:
    """A reference to another folder's journal: read, never acted on until confirmed."""
    if not isinstance(value, dict) or sorted(value) != ["folder", "journal"]:
        raise _Refused(f"unreadable ({what} is not {{journal, folder}})")
    path = value["journal"]
    if not isinstance(path, str) or not path or "\0" in path or len(path) > 4096 or os.path.isabs(path):
        raise _Refused(f"{what} journal {path!r} is not a relative path")
    path = os.path.normpath(os.path.join(folder, path))
    parsed = tempfiles.parse_name(os.path.basename(path))
    if parsed is None or parsed[1] != "journal" or os.path.dirname(path) == folder:
        raise _Refused(f"{what} journal {path!r} is not a journal of another folder")
    return path, _folder_id(value["folder"], f"{what} folder")


def _plain(value: Any, field: str, folder: str) -> str:
    """``value`` as a plain name of ``folder``, or :class:`_Refused`."""
    if not isinstance(value, str):
        raise _Refused(f"{field} {value!r} is not a file name")
    name: str = value
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise _Refused(f"{field} {name!r} is not a plain file name of the journal's folder {folder}")
    try:
        nbytes = len(os.fsencode(name))
    except UnicodeError:
        raise _Refused(f"{field} {name!r} is not a file name this system can encode") from None
    if nbytes > 255:
        raise _Refused(f"{field} {name!r} is {nbytes} bytes, longer than a file name (255)")
    return name


_ENTRY_KEYS = ("backup", "dev", "had_target", "ino", "mark", "new", "old", "target", "temp")


def _entry(row: Any, folder: str) -> JournalEntry:
    if not isinstance(row, dict):
        raise _Refused("is not an object")
    if sorted(row) != sorted(_ENTRY_KEYS):
        raise _Refused(f"has the fields {sorted(row)}, not {sorted(_ENTRY_KEYS)}")
    target = _plain(row["target"], "target", folder)
    if tempfiles.parse_name(target) is not None:
        raise _Refused(f"target {target!r} is a ptdstream temp or journal name, not a file of a set")
    want = tempfiles.stem(target)
    temp = _plain(row["temp"], "temp", folder)
    if tempfiles.parse_name(temp) != (want, "tmp"):
        raise _Refused(f"temp {temp!r} is not a temp name of target {target!r} (.{want}.ptdstream-<pid>-<hex>.tmp)")
    backup = None
    if row["backup"] is not None:
        backup = _plain(row["backup"], "backup", folder)
        if tempfiles.parse_name(backup) != (want, "bak"):
            raise _Refused(f"backup {backup!r} is not a backup name of target {target!r} "
                           f"(.{want}.ptdstream-<pid>-<hex>.bak)")
    had_target = row["had_target"]
    if type(had_target) is not bool or (backup is not None and not had_target):
        raise _Refused(f"had_target {had_target!r} does not fit backup {backup!r}")
    dev, ino = _int(row["dev"], "dev"), _int(row["ino"], "ino")
    new = _state(row["new"], "new")
    if (new.dev, new.ino) != (dev, ino):
        raise _Refused(f"new is the state of device/inode {[new.dev, new.ino]}, not of the temp file's "
                       f"{[dev, ino]}")
    old = None
    if had_target:
        old = _state(row["old"], "old")
    elif row["old"] is not None:
        raise _Refused("old is a file state, but had_target is false (no previous file to record)")
    mark = row["mark"]
    if mark is not None and not (isinstance(mark, str) and MARK_RE.fullmatch(mark)):
        raise _Refused(f"mark {repr(mark)[:80]} is neither null nor 32 lowercase hex digits")
    return JournalEntry(
        os.path.join(folder, target), os.path.join(folder, temp),
        None if backup is None else os.path.join(folder, backup), had_target, dev, ino, new, old, mark)


def _own_folder_id(folder: str) -> tuple[int, int]:
    try:
        st = os.stat(folder)
    except OSError as e:
        raise _Refused(f"unreadable (its folder: {type(e).__name__}: {e})") from None
    return st.st_dev, st.st_ino


def read_journal_file(path: str) -> Journal:
    """The journal ``path``, checked (see the module docstring); entries' paths absolute.

    Reads at most :data:`JOURNAL_MAX_NBYTES`; touches no other file (stats its folder).

    Raises:
        RecoveryError: unreadable, too large or too deep, another user's or
            writable by others, of another version, recording another folder or a
            null state, or an entry outside the journal's folder or not of
            ptdstream's shape (the message names the journal, the entry and the
            field; nothing is touched).
    """
    path = os.path.abspath(path)
    folder, own = os.path.split(path)
    index = None
    try:
        doc = _parse(_read_bytes(path))
        version = doc.get("ptdstream_journal")
        if type(version) is int and 1 <= version < JOURNAL_VERSION:
            raise _Refused(f"version {version}, written by an older ptdstream: it records no mark of its files, "
                           f"so it cannot prove them (recover it with the ptdstream that wrote it, or check the "
                           f"files by hand)")
        if type(version) is not int or version != JOURNAL_VERSION:
            raise _Refused(f"unreadable (version {version!r}; this ptdstream reads {JOURNAL_VERSION})")
        keys = ["entries", "folder", "main", "members", "ptdstream_journal"]
        if sorted(doc) != keys:
            raise _Refused(f"unreadable (fields {sorted(doc)}, not {keys})")
        folder_id = _folder_id(doc["folder"], "folder")
        here = _own_folder_id(folder)
        if folder_id != here:
            raise _Refused(f"folder {list(folder_id)} is not the device and inode of the folder it lies in "
                           f"{list(here)} (a journal copied from another folder, or planted)")
        main = None if doc["main"] is None else _ref(doc["main"], "main", folder)
        if not isinstance(doc["members"], list) or len(doc["members"]) > JOURNAL_MAX_ENTRIES:
            raise _Refused("unreadable (members is not a list of references)")
        members = [_ref(m, f"member {i}", folder) for i, m in enumerate(doc["members"])]
        if main is not None and members:
            raise _Refused("unreadable (a journal is either a set's main journal or a member, not both)")
        rows = doc["entries"]
        if not isinstance(rows, list) or not 1 <= len(rows) <= JOURNAL_MAX_ENTRIES:
            raise _Refused(f"unreadable (entries is not a list of 1 to {JOURNAL_MAX_ENTRIES} files)")
        entries: list[JournalEntry] = []
        seen: dict[str, int] = {}
        for index, row in enumerate(rows):
            entry = _entry(row, folder)
            for name in (entry.target, entry.temp, entry.backup):
                if name is not None and seen.setdefault(name, index) != index:
                    raise _Refused(f"names {os.path.basename(name)!r} again (entry {seen[name]} names it too)")
            entries.append(entry)
        index = None
        last = tempfiles.stem(os.path.basename(entries[-1].target))
        if tempfiles.parse_name(own) != (last, "journal"):
            raise _Refused(f"the journal's name is not derived from its last target "
                           f"{os.path.basename(entries[-1].target)!r} (.{last}.ptdstream-<pid>-<hex>.journal)")
    except _Refused as e:
        where = "" if index is None else f"entry {index}: "
        raise RecoveryError(
            f"journal {path}: {where}{e}; refused: the journal and every file are left in place, none touched "
            f"(a ptdstream journal names only files of its own folder; remove it by hand if no save of yours "
            f"was killed in {folder})") from None
    return Journal(path, version, folder_id, tuple(entries), main, tuple(members))
