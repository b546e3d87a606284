"""A set across folders: the journals of its folders, found only where both sides confirm it.

Each journal acts only on the files of its own folder. A set whose files lie in
several folders (``data_dir=`` elsewhere, links into several folders) has a
member journal in each folder but the last, written first, and a main journal in
the last folder, written last (the set's commit point) and removed last. A
reference to another folder's journal is followed only when the journal it names
is there, in a folder of the recorded device and inode, reads as a valid journal
of its own folder (:func:`ptdstream.write.journal_codec.read_journal_file`), and
names this journal back; anything else is refused before a file is touched. The
other folders' journals and files are only read here.
"""

from __future__ import annotations

import os

from ..errors import RecoveryError
from .journal_codec import Journal, read_journal_file

__all__ = ["set_journals"]


def _folder_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(os.path.dirname(path))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _follow(journal: Journal, ref: tuple[str, tuple[int, int]], what: str) -> Journal | None:
    """The journal ``ref`` names, ``None`` when it is gone; refused when its folder
    is not the recorded one."""
    path, folder_id = ref
    if not os.path.lexists(path):
        return None
    if _folder_id(path) != folder_id:
        raise RecoveryError(
            f"journal {journal.path}: its {what} journal {path} is in a folder of device/inode {_folder_id(path)}, "
            f"the journal recorded {folder_id} (a moved or copied folder of a set across folders); refused: "
            f"every file is left in place, none touched; recover the set where it was saved, or remove the journal")
    return read_journal_file(path)


def _names(ref: tuple[str, tuple[int, int]], journal: Journal) -> bool:
    """Whether ``ref`` names ``journal``: its file name and its folder's recorded identity."""
    return os.path.basename(ref[0]) == os.path.basename(journal.path) and ref[1] == journal.folder_id


def _refuse(journal: Journal, other: Journal, what: str) -> RecoveryError:
    return RecoveryError(
        f"journal {journal.path}: its {what} journal {other.path} does not name it back; refused: every file "
        f"is left in place, none touched (remove the journal by hand if no save of yours was killed)")


def set_journals(journal: Journal) -> tuple[Journal | None, list[Journal]]:
    """``(main, members)`` of ``journal``'s set: for a journal of one folder,
    ``(journal, [])``; for a main journal, itself and the member journals still
    there; for a member, the main journal (``None`` when it is gone: the set was
    never committed) and the members still there (this one included). Reads only.

    Raises:
        RecoveryError: a reference not confirmed by the journal it names, a folder
            not the recorded one, or a journal there that is unreadable or refused.
    """
    if journal.main is None:
        main = journal
    else:
        followed = _follow(journal, journal.main, "main")
        if followed is None:
            return None, [journal]
        main = followed
        if not any(_names(ref, journal) for ref in main.members):
            raise _refuse(journal, main, "main")
    members = []
    for ref in main.members:
        member = journal if _names(ref, journal) else _follow(main, ref, "member")
        if member is None:
            continue  # completed already: members are removed before the main journal
        if member.main is None or not _names(member.main, main):
            raise _refuse(main, member, "member")
        members.append(member)
    return main, members
