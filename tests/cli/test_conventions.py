"""The command line's conventions (zstd's and git's): ``-`` for stdin/stdout, no binary
data on a terminal, ``-o`` everywhere with defaults, ``--json`` for errors too,
``-q``, progress only on a terminal, Ctrl-C, "cannot write", the argument to blame."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import time

import pytest
from _procs import SAFETY_S
from conftest import Mlp, export, reference_files

ENV = dict(os.environ, PYTHONWARNINGS="ignore")


def ptdstream(*argv, stdin=None, input_bytes=None, **kw):
    return subprocess.run([sys.executable, "-m", "ptdstream", *map(str, argv)], input=input_bytes, stdin=stdin,
                          capture_output=True, env=ENV, timeout=SAFETY_S, **kw)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("conventions")
    from executorch.exir import ExecutorchBackendConfig

    reference_files(export(Mlp(), config=ExecutorchBackendConfig(external_constants=True)), str(folder))
    return folder


def test_pack_and_unpack_default_outputs_and_stdout(files, tmp_path):
    ptd = tmp_path / "w.ptd"
    ptd.write_bytes((files / "_default_external_constant.ptd").read_bytes())
    assert ptdstream("pack", ptd, "-q").returncode == 0
    assert (tmp_path / "w.ptd.zst").is_file()  # IN.zst, as zstd names it
    to_stdout = ptdstream("pack", ptd, "-o", "-")
    assert to_stdout.returncode == 0 and to_stdout.stdout == (tmp_path / "w.ptd.zst").read_bytes()
    assert not (tmp_path / "-").exists() and "packed" in to_stdout.stderr.decode()
    ptd.unlink()
    assert ptdstream("unpack", tmp_path / "w.ptd.zst", "-q").returncode == 0  # IN without .zst
    assert ptd.read_bytes() == (files / "_default_external_constant.ptd").read_bytes()
    piped = ptdstream("unpack", "-", "-o", "-", input_bytes=to_stdout.stdout)
    assert piped.returncode == 0 and piped.stdout == ptd.read_bytes()
    bad = ptdstream("unpack", ptd)
    assert bad.returncode == 2 and b"does not end with .zst: give the output file" in bad.stderr
    both = ptdstream("pack", ptd, "a.zst", "-o", "b.zst", cwd=tmp_path)
    assert both.returncode == 2 and b"OUT and -o name different files" in both.stderr
    assert sorted(os.listdir(tmp_path)) == ["w.ptd", "w.ptd.zst"]


def test_stdin_input_for_inspect_and_verify(files):
    data = (files / "model.pte").read_bytes()
    inspected = ptdstream("inspect", "-", "--json", input_bytes=data)
    assert inspected.returncode == 0
    found = json.loads(inspected.stdout)["files"][0]
    assert found["file_nbytes"] == len(data) and found["path"] == "- (stdin)"  # as errors name it
    verified = ptdstream("verify", "-", "--against", files / "model.pte", input_bytes=data)
    assert verified.returncode == 0 and b"identical" in verified.stdout
    junk = ptdstream("inspect", "-", input_bytes=b"junkjunkjunkjunk")
    assert junk.returncode == 1
    assert junk.stderr.decode() == ("ptdstream: invalid file: - (stdin): at offset 4: identifier b'junk' is "
                                    "neither ET.. (.pte) nor FT.. (.ptd): not an ExecuTorch file\n")


def _on_terminal(*argv, stdin_tty=False):
    """Run with stdout (or stdin) on a pseudo-terminal; returns (exit code, stderr)."""
    controller, terminal = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "ptdstream", *map(str, argv)],
                              stdout=subprocess.PIPE if stdin_tty else terminal,
                              stdin=terminal if stdin_tty else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env=ENV, timeout=SAFETY_S)
    finally:
        os.close(terminal)
        os.close(controller)
    return proc.returncode, proc.stderr.decode()


def test_binary_data_never_goes_to_or_comes_from_a_terminal(files, tmp_path):
    ptd = files / "_default_external_constant.ptd"
    code, err = _on_terminal("pack", ptd, "-o", "-")
    assert code == 2 and "refusing to write binary data to a terminal" in err
    zst = tmp_path / "w.zst"
    assert ptdstream("pack", ptd, "-o", zst, "-q").returncode == 0
    code, err = _on_terminal("extract", zst, "--segment", "0")
    assert code == 2 and "refusing to write binary data to a terminal" in err
    code, err = _on_terminal("inspect", "-", stdin_tty=True)
    assert code == 2 and "refusing to read binary data from a terminal" in err


def test_json_errors_quiet_success_and_progress_only_on_request(files, tmp_path):
    usage = ptdstream("inspect", files / "model.pte", "--bogus", "--json")
    assert usage.returncode == 2 and json.loads(usage.stdout) == {
        "ok": False, "exit_code": 2,
        "error": "ptdstream inspect: unrecognized arguments: --bogus (see ptdstream inspect --help)"}
    missing = tmp_path / "absent.pte"
    proc = ptdstream("inspect", missing, "--json")
    assert proc.returncode == 2
    assert json.loads(proc.stdout) == {"ok": False, "exit_code": 2,
                                      "error": f"ptdstream: cannot read {missing}: No such file or directory"}
    quiet = ptdstream("verify", files / "model.pte", files / "model.pte", "--against", files / "model.pte")
    assert quiet.returncode == 2  # --against compares one FILE
    ok = ptdstream("verify", files / "model.pte", "--against", files / "model.pte", "-q")
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, b"", b"")
    ptd = files / "_default_external_constant.ptd"
    plain = ptdstream("pack", ptd, "-o", tmp_path / "a.zst")
    assert plain.returncode == 0 and b"\r" not in plain.stderr  # no bar in logs
    bar = ptdstream("pack", ptd, "-o", tmp_path / "b.zst", "--progress")
    assert bar.returncode == 0 and b"packing" in bar.stderr and b"\r" in bar.stderr


def test_errors_blame_the_right_thing(files, tmp_path):
    ptd = files / "_default_external_constant.ptd"
    target = tmp_path / "no" / "such" / "dir" / "x.zst"
    proc = ptdstream("pack", ptd, "-o", target)
    assert proc.returncode == 2
    err = proc.stderr.decode()
    assert err.startswith(f"ptdstream: cannot write {target}: ") and "No such file or directory" in err
    threads = ptdstream("pack", ptd, "-o", tmp_path / "t.zst", "-T", "0")
    assert threads.returncode == 2 and b"threads 0 is below 1" in threads.stderr and b"level" not in threads.stderr
    level = ptdstream("pack", ptd, "-o", tmp_path / "t.zst", "-l", "30")
    assert level.returncode == 2 and b"zstd level 30 is outside [-7, 22]" in level.stderr
    assert os.listdir(tmp_path) == []


def test_broken_pipe_is_quiet(files):
    proc = subprocess.run(f"{sys.executable} -m ptdstream inspect {files / 'model.pte'} --json | head -c 10",
                          shell=True, capture_output=True, env=ENV, timeout=SAFETY_S)
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr and len(proc.stdout) == 10


def _sigint_default() -> None:
    """In the child: SIGINT back to its default, so Python installs its Ctrl-C
    handler even when this test runs in a background job (which ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


#: Run by the child at the end of the interpreter's start-up (``site``): one line on
#: ``IMPORT_MARK_FD`` when ``torch`` starts to import (after ptdstream's start-up Ctrl-C
#: handler is installed: ``ptdstream/__init__`` is imported first), the handshake the
#: test waits for before its SIGINT, whatever the machine's load.
TORCH_MARK = r"""
import os, sys

class _Mark:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.write(int(os.environ["IMPORT_MARK_FD"]), b"importing torch\n")
        return None

sys.meta_path.insert(0, _Mark())
"""


def _wait_mark(fd: int, child) -> bytes:
    """The line the child writes on ``fd`` (b"" if it ended first), waiting at most
    :data:`SAFETY_S` (then the child is killed and the test fails)."""
    import select

    mark = b""
    while not mark.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], SAFETY_S)
        if not ready:
            child.kill()
            pytest.fail(f"{child.args}: no mark after {SAFETY_S:.0f} s; killed")
        piece = os.read(fd, 4096)
        if not piece:
            break
        mark += piece
    return mark


@pytest.mark.slow
def test_ctrl_c_during_imports_and_during_a_write(tmp_path):
    """SIGINT while torch imports (demo) and while pack writes: one line, exit 130,
    no traceback, no temp file left. Each signal follows a handshake (torch's import
    begun; the temp file there), not a delay: under load, a SIGINT 1.5 s after the
    start came before the start-up handler and printed the interpreter's traceback."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(TORCH_MARK)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    mark_r, mark_w = os.pipe()
    env = dict(ENV, IMPORT_MARK_FD=str(mark_w),
               PYTHONPATH=os.pathsep.join(p for p in [str(site), root, ENV.get("PYTHONPATH")] if p))
    try:
        demo = subprocess.Popen([sys.executable, "-m", "ptdstream", "demo", "--out", str(tmp_path / "demo")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, pass_fds=(mark_w,),
                                preexec_fn=_sigint_default)
    finally:
        os.close(mark_w)
    try:
        mark = _wait_mark(mark_r, demo)
    finally:
        os.close(mark_r)
    assert mark == b"importing torch\n", demo.communicate(timeout=SAFETY_S)[1][-2000:]
    demo.send_signal(signal.SIGINT)
    _, err = demo.communicate(timeout=SAFETY_S)
    assert demo.returncode == 130 and err.decode().strip().splitlines()[-1] == "ptdstream: interrupted", err
    assert b"Traceback" not in err
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.write(os.urandom(1 << 20) * 300)
    pack = subprocess.Popen([sys.executable, "-m", "ptdstream", "pack", str(big), "-l", "19"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, preexec_fn=_sigint_default)
    deadline = time.monotonic() + SAFETY_S
    while not any(".ptdstream-" in n for n in os.listdir(tmp_path)):  # the write has begun
        assert pack.poll() is None, f"pack ended before its temp file was seen: {pack.communicate()}"
        assert time.monotonic() < deadline, f"no temp file after {SAFETY_S:.0f} s"
        time.sleep(0.05)
    pack.send_signal(signal.SIGINT)
    _, err = pack.communicate(timeout=SAFETY_S)
    assert pack.returncode == 130 and err.decode().strip() == "ptdstream: interrupted"
    assert sorted(n for n in os.listdir(tmp_path) if n not in ("demo", "site")) == ["big.bin"]


def test_ctrl_c_while_the_command_line_imports(monkeypatch, capsys):
    """The console script's entry point reports Ctrl-C during the CLI's own imports
    like anywhere else."""
    import builtins

    import ptdstream._entry as entry

    real_import = builtins.__import__

    def interrupted(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 1 and name == "cli":
            raise KeyboardInterrupt
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    assert entry.main() == 130
    assert capsys.readouterr().err == "ptdstream: interrupted\n"


def test_ctrl_c_while_reading_stdin_leaves_no_temp_file(monkeypatch, tmp_path):
    import io
    import types

    from ptdstream.cli import common

    class Interrupted(io.RawIOBase):
        def readinto(self, b):
            raise KeyboardInterrupt

    monkeypatch.setattr(common.sys, "stdin", types.SimpleNamespace(buffer=Interrupted(), isatty=lambda: False))
    with pytest.raises(KeyboardInterrupt):
        common.spool_stdin(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_an_os_error_without_errno_keeps_its_message(capsys):
    from ptdstream.cli import main

    assert main(["weights", "/nonexistent/model.pte", "--from", "/nonexistent/none.safetensors",
                 "-o", "/nonexistent/out"]) == 2
    err = capsys.readouterr().err
    assert "FileNotFoundError" not in err and err.startswith("ptdstream: ") and "/nonexistent/" in err, err


_NO_ROOM = """
import errno, os, sys
real_write = os.write
def write(fd, data):  # every file the command opens is full; stderr still works
    if fd > 2:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_write(fd, data)
os.write = write
from ptdstream.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_is_an_output_error_exit_1_leaving_nothing(files, tmp_path):
    """ENOSPC while unpacking (a fault injected in os.write, or stdout on /dev/full) is
    an output that could not be written: exit 1, the output named, no file left."""
    from ptdstream.pack import pack

    pack(str(files / "model.pte"), str(tmp_path / "m.zst"))
    proc = subprocess.run([sys.executable, "-c", _NO_ROOM, "unpack", str(tmp_path / "m.zst"), "-o",
                           str(tmp_path / "m.pte")], capture_output=True, env=ENV, timeout=SAFETY_S)
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert err.startswith("ptdstream: writing ") and err.endswith(f"(for {tmp_path / 'm.pte'}) at offset 0: "
                                                                  "No space left on device\n")
    assert os.listdir(tmp_path) == ["m.zst"]
    if not os.path.exists("/dev/full"):
        return
    for argv in (["unpack", tmp_path / "m.zst", "-"], ["pack", files / "model.pte", "-"]):
        with open("/dev/full", "wb") as full:
            proc = subprocess.run([sys.executable, "-m", "ptdstream", *map(str, argv)], stdout=full,
                                  stderr=subprocess.PIPE, env=ENV, timeout=SAFETY_S)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr == b"ptdstream: cannot write standard output: No space left on device\n"
