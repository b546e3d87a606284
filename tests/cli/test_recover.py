"""`ptdstream recover DIR` completes a half-published set; `verify` reports one, exit 1."""

from __future__ import annotations

import json
import os


from ptdstream.cli import main as cli_main
from ptdstream.write import journal, tempfiles


def half_published(folder):
    """a.ptd new, b.pte old, the journal on disk: what a kill between two renames leaves."""
    a, b = os.path.join(folder, "a.ptd"), os.path.join(folder, "b.pte")
    for p, data in ((a, b"old a"), (b, b"old b")):
        with open(p, "wb") as f:
            f.write(data)
    entries = []
    for p, data in ((a, b"new a"), (b, b"new b")):
        temp, fd, lock_fd = tempfiles.create_locked(p)
        os.write(fd, data)
        os.close(fd)
        os.close(lock_fd)
        backup = tempfiles.temp_name_for(p, "bak")
        os.link(p, backup)
        st = os.lstat(temp)
        entries.append(journal.JournalEntry(p, temp, backup, True, st.st_dev, st.st_ino))
    path = journal._write_journal(b, entries)
    os.replace(entries[0].temp, a)
    return path


def test_verify_reports_an_unrecovered_set_and_recover_completes_it(tmp_path, capsys):
    folder = str(tmp_path)
    jpath = half_published(folder)
    assert cli_main(["verify", os.path.join(folder, "b.pte"), "--against", os.path.join(folder, "b.pte")]) == 1
    err = capsys.readouterr().err
    assert (f"ptdstream verify: unrecovered set in {folder} (a.ptd, b.pte; journal "
            f"{os.path.basename(jpath)}): run `ptdstream recover {folder}`") in err
    assert cli_main(["recover", folder]) == 0
    assert capsys.readouterr().out == f"{folder}: completed {jpath}: rolled forward (the new set)\n"
    assert sorted(os.listdir(folder)) == ["a.ptd", "b.pte"]
    assert (tmp_path / "b.pte").read_bytes() == b"new b"
    assert cli_main(["verify", os.path.join(folder, "b.pte"), "--against", os.path.join(folder, "b.pte")]) == 0
    capsys.readouterr()
    assert cli_main(["recover", "--json", folder]) == 0
    assert json.loads(capsys.readouterr().out) == {"ok": True, "recovered": [], "failed": []}


def test_recover_exits_1_on_an_unreadable_journal(tmp_path, capsys):
    (tmp_path / ".b.pte.ptdstream-1-0000abcd.journal").write_bytes(b"{")
    assert cli_main(["recover", str(tmp_path)]) == 1
    assert "0000abcd.journal: unreadable" in capsys.readouterr().err


def test_recover_of_a_missing_folder_or_a_file_is_a_usage_error_not_all_well(tmp_path, capsys):
    (tmp_path / "model.pte").write_bytes(b"x")
    for path, what in ((tmp_path / "nosuch", "no such folder"),
                       (tmp_path / "model.pte", "not a folder (give the folder of the set)")):
        assert cli_main(["recover", str(path)]) == 2
        out, err = capsys.readouterr()
        assert (out, err) == ("", f"ptdstream recover: {path}: {what}\n")
    assert cli_main(["recover", str(tmp_path), str(tmp_path / "nosuch"), "--json"]) == 2
    out, err = capsys.readouterr()
    assert "ptdstream recover: " + str(tmp_path / "nosuch") + ": no such folder" in err
    assert '"ok": true' not in out
