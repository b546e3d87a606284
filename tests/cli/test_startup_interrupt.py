"""Ctrl-C at any moment of the ``ptdstream`` command, start-up included: one line and
exit 130, or exit 0 when the command had finished; never a traceback, never carried on."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest
import zstandard
from _procs import SAFETY_S

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(os.path.dirname(sys.executable), "ptdstream")

# Run by the child at the end of the interpreter's own start-up (``site``): when
# the start-up handler is installed, one line naming the ptdstream modules loaded
# by then; the sweep's delays count from it. (A SIGINT before it, while the
# interpreter starts, imports runpy or reads ptdstream/__init__.py and _entry.py,
# is the interpreter's to report.)
SITECUSTOMIZE = r'''
import os, sys, _signal

_install = _signal.signal

def signal(signum, handler):
    previous = _install(signum, handler)
    if getattr(handler, "ptdstream_startup", False):
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "ptdstream")
        os.write(int(os.environ["STARTUP_MARK_FD"]), ("guarded " + " ".join(loaded) + "\n").encode())
    return previous

_signal.signal = signal
'''


def _sigint_default() -> None:
    """In the child: SIGINT back to its default, so Python installs its handler even
    when the test runs in a background job (which ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(argv, delay: float, folder, env) -> tuple:
    """Run ``argv``, send SIGINT ``delay`` s after the start-up handler is installed:
    ``(returncode, stderr, time the signal was sent in ns, or None if it had ended)``."""
    mark_r, mark_w = os.pipe()
    env = dict(env, STARTUP_MARK_FD=str(mark_w))
    try:
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=folder,
                                 pass_fds=(mark_w,), preexec_fn=_sigint_default)
    finally:
        os.close(mark_w)
    try:
        mark = b""
        while not mark.endswith(b"\n"):
            ready, _, _ = select.select([mark_r], [], [], SAFETY_S)
            piece = os.read(mark_r, 4096) if ready else b""
            if not piece:
                break
            mark += piece
    finally:
        os.close(mark_r)
    if mark != b"guarded ptdstream ptdstream._entry\n":
        child.kill()
        _, err = child.communicate(timeout=SAFETY_S)
        pytest.fail(f"{argv}: the start-up handler was not installed first thing: {mark!r} {err[-2000:]!r}")
    time.sleep(delay)
    sent = None
    if child.poll() is None:
        sent = time.time_ns()
        child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=SAFETY_S)
    return child.returncode, err.decode(errors="replace"), sent


def test_sigint_at_any_moment_of_start_up_is_one_line_and_exit_130(tmp_path):
    """40 runs of ``pack``, SIGINT 0-300 ms after the start-up handler is installed
    (before any ptdstream module but ``_entry`` is loaded), through the imports,
    argument parsing, the pack and the exit, by ``python -m ptdstream`` and the
    console script. Before, a SIGINT while ``ptdstream/__init__`` imported printed a
    traceback; one after the command returned printed the shutdown's. Exit 130 leaves
    no temp file and either no output or (a signal after the publishing rename, before
    ``cli.main`` returned: ``ptdstream._entry``'s docstring) the whole output,
    published before the signal was sent (a CI run saw this at 210 ms)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), ROOT]))
    env.pop("PTDSTREAM_DEBUG", None)
    data = os.urandom(1 << 16) * 4
    launchers = [[sys.executable, "-m", "ptdstream"]]
    if os.access(SCRIPT, os.X_OK):
        launchers.append([SCRIPT])
    outcomes = []
    for i in range(40):
        delay = 0.3 * i / 40
        folder = tmp_path / f"run{i}"
        folder.mkdir()
        (folder / "in.bin").write_bytes(data)
        argv = launchers[i % len(launchers)] + ["pack", "in.bin", "-o", "out.zst", "--level", "1"]
        code, err, sent = _interrupt(argv, delay, folder, env)
        where = f"run {i} ({argv[0]}), SIGINT {delay * 1000:.0f} ms after the guard: exit {code}, stderr {err!r}"
        if code == 0:  # finished: published, and before the signal
            assert err == "", where
            out = folder / "out.zst"
            assert zstandard.ZstdDecompressor().stream_reader(out.read_bytes(), read_across_frames=True).read() \
                == data, where
            assert sent is None or os.stat(out).st_ctime_ns <= sent, f"{where}: carried on after the signal"
        else:
            assert (code, err) == (130, "ptdstream: interrupted\n"), where
            left = sorted(os.listdir(folder))
            if left != ["in.bin"]:  # the signal came after the publishing rename, on cli.main's way out
                assert left == ["in.bin", "out.zst"], where  # no temp file left
                out = folder / "out.zst"
                assert zstandard.ZstdDecompressor().stream_reader(out.read_bytes(), read_across_frames=True).read() \
                    == data, f"{where}: a published file that is not the whole pack"
                assert os.stat(out).st_ctime_ns <= sent, f"{where}: published after the signal"
        outcomes.append(code)
        shutil.rmtree(folder)
    assert outcomes[0] == 130 and outcomes.count(130) >= 10, outcomes


@pytest.mark.parametrize("argv0,orig,expected", [
    ("/venv/bin/ptdstream", None, True),
    ("-m", ["/venv/bin/python", "-X", "importtime", "-m", "ptdstream", "inspect"], True),
    ("-m", ["python", "-mptdstream"], True),
    ("-m", ["python", "-m", "ptdstream.cli"], False),
    ("-m", ["python", "-m", "pytest", "ptdstream"], False),
    ("/usr/bin/pytest", None, False),
    ("-c", ["python", "-c", "import ptdstream", "ptdstream"], False),
])
def test_only_the_ptdstream_process_gets_the_start_up_handler(monkeypatch, argv0, orig, expected):
    from ptdstream import _entry

    monkeypatch.setattr(sys, "argv", [argv0, "x"])
    monkeypatch.setattr(sys, "orig_argv", orig or ["python", argv0, "x"])
    assert _entry.is_command() is expected
    before = signal.getsignal(signal.SIGINT)
    try:
        installed = _entry.guard_startup()
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)
    assert installed is (expected and before is signal.default_int_handler)
    assert (after is not before) is installed


def test_sigint_after_the_report_keeps_the_commands_exit_code(tmp_path):
    """30 runs of ``pack``, SIGINT 0-29 ms after its report line is read from its
    stdout (flushed when the command returned), by ``python -m ptdstream`` and the
    console script: each exits 0, as the command did. Before, the interpreter's
    shutdown put SIGINT back to its default action and the process died by the signal."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("PTDSTREAM_DEBUG", None)
    env.pop("PYTHONUNBUFFERED", None)  # the report reaches the pipe when the entry point flushes it
    data = os.urandom(1 << 16)
    (tmp_path / "in.bin").write_bytes(data)
    want = b"packed in.bin (file, 65,536 bytes) -> out.zst: "
    launchers = [[sys.executable, "-m", "ptdstream"]]
    if os.access(SCRIPT, os.X_OK):
        launchers.append([SCRIPT])
    ended = []
    for i in range(30):
        argv = launchers[i % len(launchers)] + ["pack", "in.bin", "-o", "out.zst", "-f", "--level", "1"]
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path,
                                 preexec_fn=_sigint_default)
        ready, _, _ = select.select([child.stdout], [], [], SAFETY_S)
        line = child.stdout.readline() if ready else b""
        time.sleep(i // 2 / 1000)
        if child.poll() is None:
            child.send_signal(signal.SIGINT)
        else:
            ended.append(i)
        _, err = child.communicate(timeout=SAFETY_S)
        where = f"run {i} ({argv[0]}), SIGINT {i // 2} ms after the report {line!r}: exit {child.returncode}, {err!r}"
        assert (child.returncode, err, line[: len(want)]) == (0, b"", want), where
        assert zstandard.ZstdDecompressor().stream_reader((tmp_path / "out.zst").read_bytes(),
                                                          read_across_frames=True).read() == data, where
    assert len(ended) < 30, "every run had ended before its signal: the sweep tests nothing"
