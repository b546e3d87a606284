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


def tree(root):
    return {os.path.join(d, n): (open(os.path.join(d, n), "rb").read() if not os.path.islink(os.path.join(d, n))
                                 else os.readlink(os.path.join(d, n)))
            for d, _, files in os.walk(root) for n in files}


def test_verify_and_recover_find_the_journal_of_a_set_saved_through_symlinks(tmp_path, capsys):
    """The save wrote its journal beside the links' targets, not beside the links."""
    real, links = tmp_path / "real", tmp_path / "links"
    real.mkdir()
    links.mkdir()
    jpath = half_published(str(real))
    for name in ("a.ptd", "b.pte"):
        (links / name).symlink_to(real / name)
    b = str(links / "b.pte")
    assert cli_main(["verify", b, "--against", b]) == 1
    assert f"unrecovered set in {real} (a.ptd, b.pte; journal {os.path.basename(jpath)})" in capsys.readouterr().err
    assert cli_main(["recover", str(links)]) == 0
    assert capsys.readouterr().out == f"{real}: completed {jpath}: rolled forward (the new set)\n"
    assert sorted(os.listdir(real)) == ["a.ptd", "b.pte"]
    assert (links / "b.pte").read_bytes() == b"new b" and (links / "a.ptd").read_bytes() == b"new a"
    assert cli_main(["verify", b, "--against", b]) == 0


def test_a_set_whose_names_hold_a_newline_is_reported_and_recovered(tmp_path, capsys):
    folder = str(tmp_path)
    a, b = os.path.join(folder, "a\n.ptd"), os.path.join(folder, "b\n.pte")
    for p in (a, b):
        with open(p, "wb") as f:
            f.write(b"old")
    entries = []
    for p in (a, b):
        temp, fd, lock_fd = tempfiles.create_locked(p)
        os.write(fd, b"new")
        os.close(fd)
        os.close(lock_fd)
        backup = tempfiles.temp_name_for(p, "bak")
        os.link(p, backup)
        st = os.lstat(temp)
        entries.append(journal.JournalEntry(p, temp, backup, True, st.st_dev, st.st_ino))
    jpath = journal._write_journal(b, entries)
    os.replace(entries[0].temp, a)
    assert cli_main(["verify", b, "--against", b]) == 1
    err = capsys.readouterr().err  # print_error shows a newline in a name as a space
    assert f"unrecovered set in {folder} (a .ptd, b .pte; journal {os.path.basename(jpath)})".replace("\n", " ") in err
    assert cli_main(["recover", folder]) == 0
    assert capsys.readouterr().out == f"{folder}: completed {jpath}: rolled forward (the new set)\n"
    assert sorted(os.listdir(folder)) == ["a\n.ptd", "b\n.pte"]
    assert open(b, "rb").read() == b"new"


def test_recover_refuses_a_set_another_program_rewrote_exit_1(tmp_path, capsys):
    jpath = half_published(str(tmp_path))
    (tmp_path / "a.ptd").write_bytes(b"written by cp")
    before = tree(tmp_path)
    assert cli_main(["recover", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ptdstream recover: journal {jpath}: another program changed the set's files since "
                          "the save was killed (a.ptd: size is 13, the journal recorded 5)")
    assert tree(tmp_path) == before


def test_verify_and_recover_report_a_planted_deep_journal(tmp_path, capsys):
    bad = tmp_path / ".b.pte.ptdstream-1-0000abcd.journal"
    bad.write_bytes(b"[" * 200_000)
    (tmp_path / "b.pte").write_bytes(b"x")
    b = str(tmp_path / "b.pte")
    assert cli_main(["verify", b, "--against", b]) == 1
    assert "(unreadable journal; journal .b.pte.ptdstream-1-0000abcd.journal)" in capsys.readouterr().err
    assert cli_main(["recover", str(tmp_path)]) == 1
    assert (f"ptdstream recover: journal {bad}: unreadable (nested deeper than the 4 levels of a journal)"
            in capsys.readouterr().err)
    assert bad.read_bytes() == b"[" * 200_000
