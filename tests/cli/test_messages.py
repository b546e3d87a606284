"""The exact lines and exit codes of the command's small cases: a .ptd given to
verify alone, weights -q, weights' output folder, extract's usage error, and a
--help that imports none of numpy, flatbuffers or torch."""

from __future__ import annotations

import os
import subprocess
import sys

from _procs import SAFETY_S
from _small_exports import assert_only, write_reference

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


def test_verify_given_a_ptd_first_says_to_give_the_pte_first(tmp_path, capsys, monkeypatch):
    files = write_reference("external", tmp_path)
    pte, ptd = files["model.pte"], files[EXT_PTD]
    tail = "(a .ptd alone: --against REF or --manifest M)\n"
    head = (f"ptdstream verify: {ptd} is a .ptd (FlatTensor data), not a program: the structure check needs the "
            ".pte first")
    assert _run(capsys, "verify", ptd) == (
        2, "", f"{head}, then its .ptd files: ptdstream verify MODEL.pte {ptd} {tail}")
    assert _run(capsys, "verify", ptd, pte) == (
        2, "", f"{head}, then its .ptd files: ptdstream verify {pte} {ptd} {tail}")
    with open(ptd) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        assert _run(capsys, "verify", "-") == (2, "", (
            "ptdstream verify: - (stdin) is a .ptd (FlatTensor data), not a program: the structure check needs the "
            f".pte first, then its .ptd files: ptdstream verify MODEL.pte - {tail}"))
    rc, out, err = _run(capsys, "verify", pte, ptd)  # the order it asks for
    assert (rc, out.splitlines()[-1]) == (0, "OK: structure valid"), err
    assert_only(tmp_path, ["model.pte", EXT_PTD])


def _mismatch(tmp_path):
    """The external-constants program and a checkpoint of it with one key left out
    and another of the wrong dtype."""
    from _small_exports import model
    from safetensors.torch import save_file

    files = write_reference("external", tmp_path / "ref")
    state = {k: v.detach().contiguous() for k, v in model("external").state_dict().items()}
    names = sorted(state)
    wrong = {k: v for k, v in state.items() if k != names[0]}
    wrong[names[1]] = state[names[1]].double()
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    save_file(state, str(tmp_path / "ck.safetensors"))
    return files["model.pte"], tmp_path / "wrong.safetensors", tmp_path / "ck.safetensors"


def test_weights_quiet_prints_one_line_for_a_mismatch_and_nothing_when_it_writes(tmp_path, capsys):
    pte, wrong, ck = _mismatch(tmp_path)
    first = "dtype: 'a.weight' is DOUBLE (torch.float64) in the checkpoint, the program expects FLOAT"
    assert _run(capsys, "weights", "-q", pte, "--from", wrong, "-o", tmp_path / "out") == (
        1, "", f"ptdstream: {wrong} does not fit {pte} (nothing written): {first} (and 1 more problem)\n")
    rc, out, err = _run(capsys, "weights", pte, "--from", wrong, "-o", tmp_path / "out")  # without -q: all of them
    assert (rc, out, err.splitlines()) == (1, "", [
        f"ptdstream: {wrong} does not fit {pte} (2 problem(s); nothing written):", f"  {first}",
        f"  missing: 'a.bias' (FLOAT[4] dim order [0]) is not in {wrong}"])
    assert not (tmp_path / "out").exists()
    assert _run(capsys, "weights", "-q", pte, "--from", ck, "-o", tmp_path / "out") == (0, "", "")
    assert os.listdir(tmp_path / "out") == [EXT_PTD]


def test_weights_names_an_output_folder_it_cannot_create_as_not_written(tmp_path, capsys):
    pte, _, ck = _mismatch(tmp_path)
    (tmp_path / "afile").write_bytes(b"kept")
    for out in (tmp_path / "afile" / "sub", tmp_path / "afile" / "a" / "b"):  # the folder, or a parent of it
        assert _run(capsys, "weights", pte, "--from", ck, "-o", out) == (
            2, "", f"ptdstream: cannot write {out}: Not a directory\n")
    assert (tmp_path / "afile").read_bytes() == b"kept"
    assert_only(tmp_path, ["ref", "wrong.safetensors", "ck.safetensors", "afile"])
    # a file in the folder (a temp file it could not create) names the folder too; an input there stays an input
    from ptdstream.cli.common import exit_for

    out = str(tmp_path / "out")
    temp = PermissionError(13, "Permission denied", os.path.join(out, ".ptdstream-1234-model.ptd"))
    assert exit_for(temp, "weights", (), [out]) == (2, f"ptdstream: cannot write {out}: Permission denied")
    assert exit_for(temp, "weights", ()) == (2, f"ptdstream: cannot read {temp.filename}: Permission denied")
    rc, _, err = _run(capsys, "weights", tmp_path / "out" / "absent.pte", "--from", ck, "-o", out)
    assert (rc, err) == (2, f"ptdstream: cannot read {tmp_path / 'out' / 'absent.pte'}: No such file or directory\n")


def test_help_imports_neither_numpy_nor_flatbuffers_nor_torch():
    """``-X importtime`` lists every module the process imported, to its exit."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    for argv in (["--help"], ["verify", "--help"], ["pack", "--help"]):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ptdstream", *argv], capture_output=True,
                              text=True, env=env, timeout=SAFETY_S)
        modules = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in proc.stderr.splitlines()
                   if line.startswith("import time:")}
        assert proc.returncode == 0 and "ptdstream" in modules and "exit codes:" in proc.stdout, proc.stderr[-2000:]
        assert modules & {"numpy", "torch", "flatbuffers", "executorch", "zstandard"} == set(), argv


def test_pack_help_gives_the_level_pack_uses(capsys):
    from ptdstream.cli import cmd_pack
    from ptdstream.pack import compress

    assert cmd_pack.DEFAULT_LEVEL == compress.DEFAULT_LEVEL
    rc, out, _ = _run(capsys, "pack", "--help")
    assert rc == 0 and f"zstd level, -7..22 (default {compress.DEFAULT_LEVEL})" in " ".join(out.split())


def _unreadable_link(folder, name):
    """A file at ``folder/name`` that exists and cannot be opened, also by root (a
    link to ``/proc/1/environ``, mode 0400 root, where root cannot read it either),
    else None."""
    import pytest

    path = folder / name
    path.write_bytes(b"x")
    path.chmod(0)
    try:
        open(path, "rb").close()
    except PermissionError:
        return path
    path.unlink()  # root: chmod does not stop it
    try:
        open("/proc/1/environ", "rb").close()
    except PermissionError:
        os.symlink("/proc/1/environ", path)
        return path
    except OSError:
        pass
    pytest.skip("no file here that exists and cannot be read")


def test_weights_checkpoint_that_cannot_be_read_is_cannot_read_and_a_malformed_one_invalid(tmp_path, capsys):
    import json

    pte, _, _ = _mismatch(tmp_path)
    out = tmp_path / "out"
    for name in ("u.safetensors", "u.pt"):  # safetensors, torch.load
        ck = _unreadable_link(tmp_path, name)
        assert _run(capsys, "weights", pte, "--from", ck, "-o", out) == (
            2, "", f"ptdstream: cannot read {ck}: Permission denied\n")
    index = tmp_path / "model.safetensors.index.json"  # a shard it names is missing: an incomplete folder, exit 1
    index.write_text(json.dumps({"weight_map": {"a.weight": "absent.safetensors"}}))
    assert _run(capsys, "weights", pte, "--from", index, "-o", out) == (
        1, "", f"ptdstream: invalid file: {index}: shard 'absent.safetensors' (for 1 key(s): 'a.weight') is not in "
        f"{tmp_path} (the folder is incomplete: copy the shard there, or save or download the model again)\n")
    (tmp_path / "bad.safetensors").write_bytes(b"\x08" + bytes(7) + b"not json")  # reads, but malformed: exit 1
    (tmp_path / "bad.pt").write_bytes(b"not a zip archive")
    rc, out_text, err = _run(capsys, "weights", pte, "--from", tmp_path / "bad.safetensors", "-o", out)
    assert (rc, out_text, err.startswith(f"ptdstream: invalid file: {tmp_path / 'bad.safetensors'}: ")) == (
        1, "", True), err
    rc, out_text, err = _run(capsys, "weights", pte, "--from", tmp_path / "bad.pt", "-o", out)
    assert (rc, out_text, err.startswith(f"ptdstream: invalid file: {tmp_path / 'bad.pt'}: torch.load(mmap=True, "
                                         "weights_only=True) failed: ")) == (1, "", True), err
    assert not out.exists()


def test_weights_output_folder_errors_are_one_form(tmp_path, capsys):
    pte, _, ck = _mismatch(tmp_path)
    (tmp_path / "afile").write_bytes(b"kept")
    os.symlink("loop", tmp_path / "loop")  # a link to itself: ELOOP, not mkdir's EEXIST on the link
    assert _run(capsys, "weights", pte, "--from", ck, "-o", tmp_path / "afile") == (
        2, "", f"ptdstream: cannot write {tmp_path / 'afile'}: Not a directory (a file: give a folder)\n")
    for out in (tmp_path / "loop", tmp_path / "loop" / "sub"):
        assert _run(capsys, "weights", pte, "--from", ck, "-o", out) == (
            2, "", f"ptdstream: cannot write {out}: Too many levels of symbolic links\n")
    assert _run(capsys, "weights", pte, "--from", ck, "-o", "") == (
        2, "", "ptdstream weights: -o: an empty path, cannot write there; give a folder (. for this one)\n")
    assert (tmp_path / "afile").read_bytes() == b"kept"
    assert os.readlink(tmp_path / "loop") == "loop"
    assert_only(tmp_path, ["ref", "wrong.safetensors", "ck.safetensors", "afile", "loop"])


def test_extract_list_refuses_a_key_or_a_segment(tmp_path, capsys):
    ptd = write_reference("external", tmp_path / "ref")[EXT_PTD]
    packed = tmp_path / "m.ptd.zst"
    assert _run(capsys, "pack", "-q", ptd, "-o", packed)[0] == 0
    tail = "; it extracts nothing: leave out --list to extract, or the key to list\n"
    assert _run(capsys, "extract", packed, "a.weight", "--list") == (
        2, "", f"ptdstream extract: --list takes no KEY or --segment (got KEY 'a.weight'){tail}")
    assert _run(capsys, "extract", packed, "--list", "--segment", "0") == (
        2, "", f"ptdstream extract: --list takes no KEY or --segment (got --segment 0){tail}")
    rc, out, err = _run(capsys, "extract", packed, "--list")
    assert (rc, out.splitlines()[0], err) == (0, f"{packed}: ptd, {os.path.getsize(ptd):,} bytes, 4 segments", "")
    assert_only(tmp_path, ["ref", "m.ptd.zst"])


def test_an_empty_path_is_a_usage_error_naming_the_option(tmp_path, capsys):
    ptd = write_reference("external", tmp_path / "ref")[EXT_PTD]
    write = "an empty path, cannot write there; give a file name\n"
    assert _run(capsys, "manifest", ptd, "-o", "") == (2, "", f"ptdstream manifest: -o: {write}")
    assert _run(capsys, "pack", ptd, "") == (2, "", f"ptdstream pack: OUT: {write}")
    assert _run(capsys, "pack", ptd, "-o", "") == (2, "", f"ptdstream pack: -o: {write}")
    for argv in (["verify", ""], ["inspect", ptd, ""]):
        assert _run(capsys, *argv) == (
            2, "", f"ptdstream {argv[0]}: an empty path as an input file; give a file name\n")
    assert_only(tmp_path / "ref", ["model.pte", EXT_PTD])  # no manifest at its default path, no .zst
