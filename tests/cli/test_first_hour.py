"""A user's first hour with the command line: -q still prints why verify failed, the
integrity hint of a structure-only verify, stdin named one way, usage errors answered
before torch is imported, weights' -o folder created and its mismatch report one problem
per line, demo --reference in --help."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest
from _procs import SAFETY_S
from _small_exports import model, patched, truncated, write_reference

from ptdstream.cli import main
from ptdstream.cli.cmd_verify import INTEGRITY_HINT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXT_PTD = "_default_external_constant.ptd"


def _run(capsys, *argv):
    capsys.readouterr()
    rc = main([os.fspath(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_quiet_verify_still_prints_the_one_line_failure(tmp_path, capsys):
    files = write_reference("external", tmp_path / "ref")
    bad = truncated(files[EXT_PTD], 700, tmp_path / "cut.ptd")
    rc, out, err = _run(capsys, "verify", "-q", files["model.pte"], bad)
    assert (rc, out) == (1, "") and err.count("\n") == 1
    assert err.startswith(f"ptdstream verify: INVALID {bad}: parse: {bad}: at offset 40: segment_data_size 396")
    assert err.endswith(" (and 1 more failed check)\n")  # the external tensors it held are missing too
    copy = patched(files[EXT_PTD], 200, b"\x00", out=tmp_path / "copy.ptd")
    rc, out, err = _run(capsys, "verify", "-q", copy, "--against", files[EXT_PTD])
    assert (rc, out) == (1, "")
    assert err.startswith(f"ptdstream verify: MISMATCH {copy}: first difference at offset 200 (0xc8)")
    assert err.count("\n") == 1
    assert _run(capsys, "manifest", "-q", files[EXT_PTD], "-o", tmp_path / "m.manifest") == (0, "", "")
    rc, out, err = _run(capsys, "verify", "-q", copy, "--manifest", tmp_path / "m.manifest")
    assert (rc, out) == (1, "") and err.startswith(f"ptdstream verify: BAD {copy}") and err.count("\n") == 1
    assert _run(capsys, "verify", "-q", files["model.pte"], files[EXT_PTD]) == (0, "", "")


def test_a_structure_only_verify_prints_the_integrity_hint_on_stderr(tmp_path, capsys):
    files = write_reference("external", tmp_path)
    rc, out, err = _run(capsys, "verify", files["model.pte"], files[EXT_PTD])
    assert (rc, err) == (0, INTEGRITY_HINT + "\n") and out.endswith("OK: structure valid\n")
    assert INTEGRITY_HINT == ("ptdstream verify: structure checked, not the bytes (a changed weight or delegate byte "
                              "passes, as it loads in the runtime); --against REF or --manifest M proves the bytes")
    rc, out, err = _run(capsys, "verify", files["model.pte"], files[EXT_PTD], "--json")
    assert (rc, err) == (0, INTEGRITY_HINT + "\n") and json.loads(out)["ok"] is True
    assert _run(capsys, "verify", files["model.pte"], "--against", files["model.pte"])[2] == ""
    help_text = subprocess.run([sys.executable, "-m", "ptdstream", "verify", "--help"], capture_output=True,
                               text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=SAFETY_S).stdout
    flat = " ".join(help_text.split())
    assert ("Structure is not integrity: the structure checks are what the runtime checks when it loads the "
            "program") in flat and "--against REF or --manifest M prove the bytes" in flat
    assert "--kernels LIB[,LIB...]" in flat and "llm (LLM custom ops" in flat


def test_stdin_is_named_the_same_way_in_reports_and_errors(tmp_path, capsys, monkeypatch):
    files = write_reference("external", tmp_path)
    for argv in (["verify", "-"], ["verify", "-", "--json"], ["inspect", "-"], ["inspect", "-", "--json"]):
        with open(files["model.pte"]) as stdin:
            monkeypatch.setattr(sys, "stdin", stdin)
            rc, out, err = _run(capsys, *argv)
        assert rc in (0, 1) and "- (stdin)" in out, out
        assert "ptdstream-" not in out + err and "/stdin" not in out + err
    bad = truncated(files["model.pte"], 100, tmp_path / "cut.pte")
    with open(bad) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        rc, out, err = _run(capsys, "verify", "-q", "-")
    assert (rc, out) == (1, "") and err.startswith("ptdstream verify: INVALID - (stdin): parse: - (stdin): ")


def _timed(*argv: str) -> tuple[subprocess.CompletedProcess, float, list[str]]:
    """Run ``python -X importtime -m ptdstream ARGV``: the process, its CPU seconds, the
    modules it imported."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ptdstream", *argv], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=ROOT, PTDSTREAM_DEBUG="1"), timeout=SAFETY_S)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    modules = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    # PTDSTREAM_DEBUG keeps stderr open through the imports: without it the -X importtime
    # lines are silenced with the third-party chatter and no module would be seen.
    assert "ptdstream.cli" in modules, "no -X importtime output: the import check would see nothing"
    return proc, cpu, modules


def test_usage_errors_answer_before_torch_is_imported(tmp_path):
    pte, ck, afile = tmp_path / "model.pte", tmp_path / "ck.safetensors", tmp_path / "afile"
    pte.write_bytes(b"x")
    ck.write_bytes(b"x")
    afile.write_bytes(b"x")
    out = tmp_path / "out"
    cases = [
        (["weights", tmp_path / "absent.pte", "--from", ck, "-o", out],
         f"ptdstream: cannot read {tmp_path / 'absent.pte'}: No such file or directory"),
        (["weights", pte, "--from", tmp_path / "absent", "-o", out],
         f"ptdstream: cannot read {tmp_path / 'absent'}: No such file or directory"),
        (["weights", pte, "--from", ck, "-o", afile],
         f"ptdstream: cannot write {afile}: Not a directory (a file: give a folder)"),
        (["weights", pte, "--from", ck, "-o", ""],
         "ptdstream weights: -o: an empty path, cannot write there; give a folder (. for this one)"),
        (["weights", pte, "--from", ck, "-o", out, "--segment-alignment", "0"],
         "ptdstream weights: --segment-alignment must be a positive number of bytes, got 0"),
        (["demo", "--out", afile], f"ptdstream demo: --out {afile} exists and is not a folder"),
        (["demo", "--out", out, "--reference", str(out) + "/"],
         f"ptdstream demo: --reference {out}/ is the output folder; give another folder (executorch's files "
         "would replace ptdstream's)"),
    ]
    for argv, message in cases:
        proc, cpu, modules = _timed(*map(str, argv))
        lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
        assert (proc.returncode, lines, proc.stdout) == (2, [message], ""), argv
        assert "torch" not in modules and "executorch" not in modules, argv
        assert cpu < 1.5, (argv, cpu)  # importing torch alone takes several seconds
    assert sorted(os.listdir(tmp_path)) == ["afile", "ck.safetensors", "model.pte"]


@pytest.fixture
def program(tmp_path):
    """The external-constants program, and its weights as a safetensors checkpoint."""
    from safetensors.torch import save_file

    files = write_reference("external", tmp_path / "ref")
    state = {k: v.detach().contiguous() for k, v in model("external").state_dict().items()}
    save_file(state, str(tmp_path / "ck.safetensors"))
    return files, state


def test_weights_creates_its_output_folder_and_lists_a_mismatch_one_problem_per_line(program, tmp_path, capsys):
    from safetensors.torch import save_file

    files, state = program
    names = sorted(state)
    wrong = {k: v for k, v in state.items() if k != names[0]}
    wrong[names[1]] = state[names[1]].double()
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    out = tmp_path / "new" / "a" / "b"
    rc, stdout, err = _run(capsys, "weights", "-v", files["model.pte"], "--from", tmp_path / "wrong.safetensors",
                           "-o", out)
    lines = err.splitlines()
    assert (rc, stdout) == (1, "") and len(lines) == 3, err
    assert lines[0] == (f"ptdstream: {tmp_path / 'wrong.safetensors'} does not fit {files['model.pte']} "
                        "(2 problem(s); nothing written):")
    assert all(line.startswith("  ") for line in lines[1:])
    assert any(names[0] in line for line in lines[1:]) and any(names[1] in line for line in lines[1:])
    assert not (tmp_path / "new").exists()  # the folders it created are gone again
    rc, stdout, err = _run(capsys, "weights", "-v", files["model.pte"], "--from", tmp_path / "ck.safetensors",
                           "-o", out)
    assert rc == 0, err
    assert os.listdir(out) == [EXT_PTD]
    assert (out / EXT_PTD).read_bytes() == open(files[EXT_PTD], "rb").read()


def test_demo_help_names_reference(capsys):
    rc, out, _ = _run(capsys, "demo", "--help")
    flat = " ".join(out.split())
    assert rc == 0 and "--reference DIR" in flat
    assert "the ref/ of `ptdstream verify OUT/model.pte --against DIR/model.pte`" in flat
