"""Claim 1: a journal naming a subfolder of its folder is refused without touching any file.

Expected: ptdstream.recover(folder) raises RecoveryError naming the entry, and
          every file (a.ptd included) keeps its bytes.
Actual:   the journal passes read_journal_file and check_on_disk (a plain name;
          the directory's recorded state matches), roll-forward renames a.ptd's
          temp over a.ptd, then fails on the directory with IsADirectoryError:
          a.ptd is new, 'sub' is untouched, the journal stays: a half-applied
          journal, raised as RecoveryError only after a file was replaced.

Run: PYTHONPATH=. python tools/repro/journal_subfolder_target.py   (exit 1 = bug present)
"""
import os
import sys
import tempfile

from ptdstream.write import journal, tempfiles

with tempfile.TemporaryDirectory() as folder:
    a = os.path.join(folder, "a.ptd")
    sub = os.path.join(folder, "sub")
    open(a, "wb").write(b"old a")
    os.mkdir(sub)
    open(os.path.join(sub, "inner"), "wb").write(b"x")
    entries = []
    for target, had in ((a, True), (sub, True)):
        temp, fd, lock = tempfiles.create_locked(target)
        os.write(fd, b"new " + os.path.basename(target).encode())
        os.close(fd)
        os.close(lock)
        st = os.lstat(temp)
        entries.append(journal.JournalEntry(target, temp, None, had, st.st_dev, st.st_ino))
    jpath = journal._write_journal(sub, entries)  # what a planted journal holds: plain names, true states
    try:
        journal.recover(folder)
        outcome = "recovered"
    except journal.RecoveryError as e:
        outcome = f"RecoveryError: {str(e)[:200]}"
    except OSError as e:
        outcome = f"{type(e).__name__}: {e}"
    a_now = open(a, "rb").read()
    print("outcome:", outcome)
    print("a.ptd now:", a_now, "| journal still there:", os.path.exists(jpath))
    if a_now != b"old a":
        print("BUG: a.ptd was replaced although the journal names a subfolder (expected: refused, nothing touched)")
        sys.exit(1)
    print("OK: refused, a.ptd untouched")
