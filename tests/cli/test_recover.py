"""`ptdstream recover DIR` completes a half-published set; `verify` reports one, exit 1."""

from __future__ import annotations

import json
import os

import pytest
from _journals import killed_set

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
    assert json.loads(capsys.readouterr().out) == {"ok": True, "recovered": [], "failed": [], "not_followed": []}


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


def test_recover_follows_the_links_of_a_set_saved_through_symlinks_only_when_asked(tmp_path, capsys):
    """The save wrote its journal beside the links' targets, not beside the links:
    ``recover links/`` names that folder's journal and touches nothing there (no
    journal of links/ records a save through the links); ``--follow-links`` recovers it."""
    real, links = tmp_path / "real", tmp_path / "links"
    real.mkdir()
    links.mkdir()
    jpath = half_published(str(real))
    for name in ("a.ptd", "b.pte"):
        (links / name).symlink_to(real / name)
    b = str(links / "b.pte")
    assert cli_main(["verify", b, "--against", b]) == 1
    assert f"unrecovered set in {real} (a.ptd, b.pte; journal {os.path.basename(jpath)})" in capsys.readouterr().err
    before = tree(tmp_path)
    assert cli_main(["recover", str(links)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"ptdstream recover: {links / 'a.ptd'} links into {real}, which holds a pending journal "
                   f"({os.path.basename(jpath)}): not recovered, no journal of {links} records a save through the "
                   f"link; run `ptdstream recover {real}`, or `ptdstream recover --follow-links {links}`\n")
    assert tree(tmp_path) == before
    assert cli_main(["recover", "--follow-links", str(links)]) == 0
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


def dead_leftovers(folder):
    """An unlocked temp file and a backup of dead writers (no journal claims them)."""
    temp, fd, lock_fd = tempfiles.create_locked(os.path.join(folder, "x.bin"))
    os.write(fd, b"a dead writer's")
    os.close(fd)
    os.close(lock_fd)
    (folder / "y.bin").write_bytes(b"y")
    os.link(folder / "y.bin", tempfiles.temp_name_for(str(folder / "y.bin"), "bak"))


@pytest.mark.parametrize("pending", [False, True], ids=["leftovers only", "and a journal"])
def test_recover_dir_leaves_alone_a_folder_a_link_of_dir_points_into(tmp_path, capsys, pending):
    """A link is no record of a save: the other folder is not locked, recovered or
    cleaned (its backups and dead writers' temp files stay); a journal there is named."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    (other / "shared.txt").write_bytes(b"someone else's")
    (mine / "shortcut").symlink_to(other / "shared.txt")
    dead_leftovers(other)
    jpath = half_published(str(other)) if pending else None
    before = tree(tmp_path)
    code = cli_main(["recover", "--json", str(mine)])
    assert tree(tmp_path) == before
    assert code == (1 if pending else 0)
    report = json.loads(capsys.readouterr().out)
    assert report["recovered"] == [] and report["failed"] == []
    assert report["not_followed"] == ([{"from": str(mine), "link": str(mine / "shortcut"), "folder": str(other),
                                        "journals": [jpath]}] if pending else [])
    assert cli_main(["recover", "--follow-links", str(mine)]) == 0
    capsys.readouterr()
    assert sorted(os.listdir(other)) == sorted(["shared.txt", "y.bin"] + (["a.ptd", "b.pte"] if pending else []))


def test_a_journal_of_dir_naming_its_set_in_another_folder_completes_both_without_the_option(tmp_path, capsys):
    """A save through a link of out/ into data/ (a set across folders): out/'s own
    journal records it, so ``recover out/`` completes data/'s part too."""
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    out.mkdir()
    (out / "w.ptd").symlink_to(data / "w.ptd")
    journals, _ = killed_set([data / "w.ptd", out / "m.pte"])
    assert cli_main(["recover", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}: completed {journals[1]}: rolled forward (the new set)\n"
    assert sorted(os.listdir(data)) == ["w.ptd"] and sorted(os.listdir(out)) == ["m.pte", "w.ptd"]
    assert (out / "w.ptd").read_bytes() == b"new w.ptd" and (out / "m.pte").read_bytes() == b"new m.pte"


def test_a_link_to_a_folder_is_no_target_and_is_not_followed_even_when_asked(tmp_path, capsys):
    """A save writes through a link to a file; a link to a folder named the
    folder above it (the dirname of the resolved path), whose leftovers went."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    (mine / "up").symlink_to(other)
    dead_leftovers(tmp_path)
    before = tree(tmp_path)
    assert cli_main(["recover", "--follow-links", str(mine)]) == 0
    assert capsys.readouterr().out == f"nothing to recover in {mine}\n"
    assert tree(tmp_path) == before
