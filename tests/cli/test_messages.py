"""The exact lines and exit codes of the command's small cases: a .ptd given to
verify alone, weights -q, weights' output folder, extract's usage error, and a
--help that imports none of numpy, flatbuffers or torch."""

from __future__ import annotations

import os
import subprocess
import sys

from _models_rv import assert_only, write_reference

from ptdstream.cli import main

EXT_PTD = "_default_external_constant.ptd"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(capsys, *argv):
    capsys.readouterr()  # drop what exports printed before the command ran
    rc = main([os.fspath(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_extract_usage_error_has_the_prefix_of_every_command_usage_error(tmp_path, capsys):
    ptd = write_reference("external", tmp_path / "ref")[EXT_PTD]
    packed = tmp_path / "m.ptd.zst"
    assert _run(capsys, "pack", "-q", ptd, "-o", packed)[0] == 0
    for argv in ([packed], [packed, "a.weight", "--segment", "0"]):
        assert _run(capsys, "extract", *argv) == (
            2, "", "ptdstream extract: give exactly one of KEY or --segment INDEX (or --list)\n")
    assert _run(capsys, "pack", "-q", ptd, tmp_path / "x.zst", "-o", "y")[2] == (
        f"ptdstream pack: OUT and -o name different files ({tmp_path / 'x.zst'}, y); give one\n")
    assert_only(tmp_path, ["ref", "m.ptd.zst"])


def test_verify_given_a_ptd_first_says_to_give_the_pte_first(tmp_path, capsys):
    files = write_reference("external", tmp_path)
    pte, ptd = files["model.pte"], files[EXT_PTD]
    tail = "(a .ptd alone: --against REF or --manifest M)\n"
    head = f"ptdstream verify: {ptd} is a .ptd (FlatTensor data), not a program: the structure check needs the .pte first"
    assert _run(capsys, "verify", ptd) == (
        2, "", f"{head}, then its .ptd files: ptdstream verify MODEL.pte {ptd} {tail}")
    assert _run(capsys, "verify", ptd, pte) == (
        2, "", f"{head}, then its .ptd files: ptdstream verify {pte} {ptd} {tail}")
    rc, out, err = _run(capsys, "verify", pte, ptd)  # the order it asks for
    assert (rc, out.splitlines()[-1]) == (0, "OK: structure valid"), err
    assert_only(tmp_path, ["model.pte", EXT_PTD])
