"""ptdstream.cli: exit codes, one-line errors, --json, --help, demo dispatch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types

import pytest
from _small_exports import assert_only, patched, truncated, write_reference

from ptdstream.cli import main
from ptdstream.cli.cmd_verify import INTEGRITY_HINT

EXT_PTD = "_default_external_constant.ptd"


def _run(capsys, *argv):
    capsys.readouterr()  # drop what exports printed before the command ran
    rc = main([os.fspath(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err
    return err.strip()


def test_verify_against_identical_reference_exits_0(tmp_path, capsys):
    ref = write_reference("xnnpack", tmp_path / "ref")["model.pte"]
    out = shutil.copy(ref, tmp_path / "out.pte")
    rc, stdout, err = _run(capsys, "verify", out, "--against", ref)
    assert (rc, err) == (0, "")
    assert stdout == f"OK {out}: identical to {ref} (3,212 bytes)\n"


def test_verify_against_reports_first_difference_and_exits_1(tmp_path, capsys):
    ref = write_reference("xnnpack", tmp_path / "ref")["model.pte"]
    out = patched(ref, 2821, b"\x00", out=tmp_path / "out.pte")
    rc, stdout, _ = _run(capsys, "verify", out, "--against", ref, "--json")
    data = json.loads(stdout)
    assert rc == 1 and data["ok"] is False
    assert (data["first_diff_offset"], data["section"], data["ref_nbytes"]) == (2821, "named data", 3212)
    assert data["key"] == "2fde66a9f2012fda28059b58e6b15d99c8e0829e2113e99d2e25d5bad3d852b3"
    rc, stdout, _ = _run(capsys, "verify", out, "--against", ref)
    assert rc == 1 and stdout.startswith(f"MISMATCH {out}: first difference at offset 2,821 (0xb05) in named data")
    assert_only(tmp_path, ["ref", "out.pte"])


def test_verify_structure_exit_codes(tmp_path, capsys):
    files = write_reference("external", tmp_path)
    rc, stdout, err = _run(capsys, "verify", files["model.pte"], files[EXT_PTD])
    assert (rc, err) == (0, INTEGRITY_HINT + "\n") and stdout.endswith("OK: structure valid\n")
    rc, stdout, _ = _run(capsys, "verify", files["model.pte"], "--json")
    data = json.loads(stdout)
    assert rc == 1 and data["ok"] is False
    assert [c["name"] for c in data["checks"] if not c["ok"]] == ["external data"]
    bad = truncated(files[EXT_PTD], 700, tmp_path / "cut.ptd")
    rc, stdout, _ = _run(capsys, "verify", files["model.pte"], bad)
    assert rc == 1
    assert f"FAIL {bad}: parse: {bad}: at offset 40: segment_data_size 396" in stdout
    assert_only(tmp_path, ["model.pte", EXT_PTD, "cut.ptd"])


def test_missing_file_exits_2_with_one_line(tmp_path, capsys):
    ref = write_reference("plain", tmp_path)["model.pte"]
    missing = str(tmp_path / "absent.pte")
    for argv in (["verify", missing, "--against", ref], ["verify", ref, "--against", missing],
                 ["verify", missing], ["verify", ref, missing], ["inspect", ref, missing]):
        rc, stdout, err = _run(capsys, *argv)
        assert rc == 2 and stdout == ""
        assert _one_line(err) == f"ptdstream: cannot read {missing}: No such file or directory"
    rc, _, err = _run(capsys, "inspect", str(tmp_path))
    assert rc == 2 and _one_line(err) == f"ptdstream: cannot read {tmp_path}: is a directory"
    assert_only(tmp_path, ["model.pte"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_permission_denied_exits_2(tmp_path, capsys):
    ref = write_reference("plain", tmp_path)["model.pte"]
    os.chmod(ref, 0)
    try:
        rc, _, err = _run(capsys, "inspect", ref)
    finally:
        os.chmod(ref, 0o644)
    assert rc == 2 and "Permission denied" in _one_line(err)


def test_permission_error_from_the_reader_exits_2(tmp_path, capsys, monkeypatch):
    ref = write_reference("plain", tmp_path)["model.pte"]

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", os.fspath(path))

    monkeypatch.setattr("ptdstream.format.reader.open_input", denied)  # the reader opens its file through it
    rc, stdout, err = _run(capsys, "verify", ref)
    assert (rc, stdout) == (2, "")
    assert _one_line(err) == f"ptdstream: cannot read {ref}: Permission denied"


@pytest.mark.parametrize("argv,message", [
    ([], None),
    (["verify"], "ptdstream verify: the following arguments are required: FILE (see ptdstream verify --help)"),
    (["verify", "a", "b", "--against", "c"],
     "ptdstream verify: --against compares one FILE, got 2 (see ptdstream verify --help)"),
    (["bogus"], "ptdstream: argument COMMAND: invalid choice: 'bogus' (choose from 'verify', "
                "'inspect', 'manifest', 'pack', 'unpack', 'extract', 'weights', 'recover', 'demo')"
                " (see ptdstream --help)"),
    (["inspect", "--frobnicate", "x"],
     "ptdstream inspect: unrecognized arguments: --frobnicate (see ptdstream inspect --help)"),
    (["--frobnicate"], "ptdstream: unrecognized arguments: --frobnicate (see ptdstream --help)"),
])
def test_usage_errors_exit_2(capsys, argv, message):
    rc, stdout, err = _run(capsys, *argv)
    assert rc == 2 and stdout == ""
    if message is not None:
        assert _one_line(err) == message
    else:
        assert err.startswith("usage: ptdstream")


def test_help_lists_examples_and_exit_codes(capsys):
    rc, stdout, err = _run(capsys, "--help")
    assert (rc, err) == (0, "")
    assert "examples:" in stdout and "ptdstream verify out/model.pte --against ref/model.pte" in stdout
    assert "exit codes:" in stdout and "2  usage error" in stdout
    for command, example in [("verify", "ptdstream verify out/model.pte --against ref/model.pte"),
                             ("inspect", "ptdstream inspect model.pte model.ptd"),
                             ("manifest", "ptdstream manifest out/model.pte out/model.ptd"),
                             ("pack", "ptdstream pack model.ptd"), ("unpack", "ptdstream unpack model.ptd.zst"),
                             ("extract", "ptdstream extract model.ptd.zst --list"),
                             ("recover", "ptdstream recover out/"), ("demo", "ptdstream demo ")]:
        rc, stdout, err = _run(capsys, command, "-h")
        assert (rc, err) == (0, "")
        examples = stdout.split("examples:\n", 1)[1]
        assert examples.lstrip().startswith(example), command  # its own examples, not the global list
        assert "exit codes:" in stdout and "--quiet" in stdout, command


def test_inspect_text_json_and_invalid(tmp_path, capsys):
    files = write_reference("tied", tmp_path)
    rc, stdout, err = _run(capsys, "inspect", files["model.pte"])
    assert (rc, err) == (0, "")
    assert "duplicated content: 4,096 bytes in 1 groups" in stdout
    rc, stdout, _ = _run(capsys, "inspect", files["model.pte"], "--json")
    data = json.loads(stdout)
    assert rc == 0 and data["duplicated_nbytes"] == 4096 and data["files"][0]["file_nbytes"] == 10368
    patched(files["model.pte"], 16, (1 << 60).to_bytes(8, "little"))
    rc, stdout, err = _run(capsys, "inspect", files["model.pte"])
    assert rc == 1 and stdout == ""
    assert _one_line(err).startswith(f"ptdstream: invalid file: {files['model.pte']}: at offset 16: program_size")
    assert_only(tmp_path, ["model.pte"])


def test_demo_dispatches_to_demo_main(monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("ptdstream.demo.run")
    fake.main = lambda args: seen.append((args.out, args.no_run)) or 3
    monkeypatch.setitem(sys.modules, "ptdstream.demo.run", fake)
    import ptdstream.demo

    monkeypatch.setattr(ptdstream.demo, "run", fake, raising=False)
    assert main(["demo"]) == 3
    assert main(["demo", "--out", "/somewhere", "--no-run"]) == 3
    assert seen == [("./ptdstream-demo", False), ("/somewhere", True)]


def test_demo_failure_is_one_line(monkeypatch, capsys):
    fake = types.ModuleType("ptdstream.demo.run")

    def boom(args):
        raise RuntimeError("export failed\nwith details")

    fake.main = boom
    monkeypatch.setitem(sys.modules, "ptdstream.demo.run", fake)
    import ptdstream.demo

    monkeypatch.setattr(ptdstream.demo, "run", fake, raising=False)
    rc, _, err = _run(capsys, "demo", "--no-run")
    assert rc == 1
    assert _one_line(err) == ("ptdstream: demo failed: RuntimeError: export failed with details "
                              "(-v or PTDSTREAM_DEBUG=1 for a traceback)")


def test_python_dash_m_entry_point(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, "-m", "ptdstream", "--help"], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and "exit codes:" in result.stdout
    missing = str(tmp_path / "absent.pte")
    result = subprocess.run([sys.executable, "-m", "ptdstream", "verify", missing], capture_output=True,
                            text=True, env=env)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"ptdstream: cannot read {missing}: No such file or directory\n"
    assert_only(tmp_path, [])


def test_fifo_and_devices_exit_2_without_blocking(tmp_path, capsys):
    """Regression: opening a FIFO blocked forever; /dev/zero was read forever."""
    fifo = tmp_path / "pipe.pte"
    os.mkfifo(fifo)
    for argv in (["verify", str(fifo)], ["inspect", str(fifo)], ["verify", "/dev/zero", "--against", "/dev/zero"]):
        code, _, err = _run(capsys, *argv)
        assert code == 2 and "not a regular file" in err


def test_non_utf8_file_names_are_printed_escaped(tmp_path, capsys):
    """Regression: a file name that is not UTF-8 crashed the report."""
    paths = write_reference("plain", tmp_path / "ref")
    odd = os.path.join(os.fsencode(str(tmp_path)), b"s\xff.pte")
    shutil.copy(paths["model.pte"], odd)
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    proc = subprocess.run([sys.executable, "-m", "ptdstream", "verify", odd], capture_output=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert b"s\\udcff.pte" in proc.stdout or b"s\\xff.pte" in proc.stdout


def test_demo_quiet_prints_the_summary_only_when_it_fails(monkeypatch, tmp_path, capsys):
    import ptdstream.demo.run as demo_run

    result = types.SimpleNamespace(exit_code=0)
    monkeypatch.setattr(demo_run, "run_demo", lambda *a, **k: result)
    monkeypatch.setattr(demo_run, "format_summary", lambda r: f"summary {r.exit_code}")
    assert _run(capsys, "demo", "--out", tmp_path, "--no-run", "-q") == (0, "", "")
    assert _run(capsys, "demo", "--out", tmp_path, "--no-run") == (0, "summary 0\n", "")
    result.exit_code = 1
    assert _run(capsys, "demo", "--out", tmp_path, "--no-run", "-q") == (1, "", "summary 1\n")
