"""A save killed before each of its publishing calls and, where that leaves a journal,
the recovery killed before each of its own calls, then recovered again: the folder
holds exactly the old set or exactly the new one (the README's claim 7)."""

from __future__ import annotations

import collections
import os
import shutil

import pytest
from _procs import killed_at
from conftest import read_folder as read_all
from conftest import write_two_file_set as _write_set

from ptdstream.system import fsops
from ptdstream.write import journal

# --- claim 7: kills at every publishing call, and at every call of the recovery after it ---------------------


def test_a_recovery_killed_at_each_of_its_calls_still_ends_old_or_new(tmp_path):
    """The save killed before each of its publishing calls; where that leaves a
    journal, the recovery itself killed before each of its calls, then recovered
    again: the folder holds exactly the old set or exactly the new one."""
    folder = tmp_path / "f"

    def fresh_old():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        _write_set(folder, 0)

    fresh_old()
    old = read_all(folder)
    ops = []
    previous = fsops.set_hook(lambda op, path: ops.append(op))
    try:
        _write_set(folder, 1)
    finally:
        fsops.set_hook(previous)
    new = read_all(folder)
    assert sorted(old) == sorted(new) == ["a.ptd", "b.ptd"] and old["a.ptd"] != new["a.ptd"]
    outcomes = collections.Counter()
    with_journal = []
    for n in range(1, len(ops) + 1):
        fresh_old()
        assert killed_at(n, lambda: _write_set(folder, 1))
        if journal.unrecovered(str(folder)):
            with_journal.append(n)
        journal.recover(str(folder))
        assert read_all(folder) in (old, new), (n, sorted(os.listdir(folder)))
    assert with_journal, "no kill point left a journal"
    for n in (with_journal[0], with_journal[len(with_journal) // 2], with_journal[-1]):
        for m in range(1, 40):
            fresh_old()
            assert killed_at(n, lambda: _write_set(folder, 1))
            killed = killed_at(m, lambda: journal.recover(str(folder)))
            journal.recover(str(folder))
            assert journal.unrecovered(str(folder)) == []
            after = read_all(folder)
            assert after in (old, new), (n, m, sorted(after))
            outcomes["old" if after == old else "new"] += 1
            if not killed:
                break
        else:
            pytest.fail("a recovery of more than 40 calls")
    assert sum(outcomes.values()) >= 6
