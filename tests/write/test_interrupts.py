"""Ctrl-C while saving: the helper threads end before the file descriptors they
use are closed, and nothing is left behind."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from _procs import SAFETY_S

from ptdstream.write import sink as sink_module
from ptdstream.write.sink import ChunkedFileSink
from ptdstream.write.writer import _WriterThread


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_abort_after_an_interrupted_hand_off_ends_the_thread():
    """Ctrl-C right after write() took the idle slot: close() would wait for that
    slot forever; abort() ends the thread."""

    class Sink:
        def write(self, data):
            pass

    writer = _WriterThread(Sink())
    writer._wait_idle()  # the state an interrupted hand-off leaves: the caller holds the slot
    done = threading.Thread(target=writer.abort, daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive(), "abort() hung"
    assert not writer._thread.is_alive()


def test_ctrl_c_in_the_sink_constructor_leaves_no_temp_file(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sink_module, "WritebackWindows", interrupted)
    gc.collect()  # no garbage of earlier tests left for a collection to close files of in between
    gc.disable()
    try:
        before = _open_fds()
        with pytest.raises(KeyboardInterrupt):
            ChunkedFileSink(str(tmp_path / "model.ptd"))
        after = _open_fds()
    finally:
        gc.enable()
    assert os.listdir(tmp_path) == []
    assert after == before  # the temp file's fd and its lock fd are closed


SLOW_SAVE_TWO_CTRL_C = r"""
import os, signal, sys, threading, time
from ptdstream import StreamingNamedDataStore
from ptdstream.format.plan import SavePlan
from ptdstream.format.ptd import plan_data_files
from ptdstream.format.pte import PteOptions
from ptdstream.write.set_writer import write_save_plan
from ptdstream.write.sink import ChunkedFileSink

MiB = 1 << 20
folder = sys.argv[1]
store = StreamingNamedDataStore()
store.add_named_data("a", os.urandom(40 * MiB), external_tag="model")
out = store.get_named_data_store_output()
files = plan_data_files(out.buffers, out.external_data, folder, segment_alignment=128,
                        fingerprints=out.fingerprints)

writing, both_sent = threading.Event(), threading.Event()

def slow_write(fd, view):  # a slow disk: the writer thread is outside write(2) until both Ctrl-C came
    if len(view) >= MiB:
        writing.set()
        both_sent.wait()  # the test's subprocess limit ends a hang
    return os.write(fd, view)

def ctrl_c_twice():  # both while the writer thread's first write is in progress, whatever the machine's load
    writing.wait()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1.0)  # the save is back waiting for the writer
    both_sent.set()

threading.Thread(target=ctrl_c_twice, daemon=True).start()
try:
    write_save_plan(SavePlan(files, None, PteOptions(segment_alignment=128), 0), chunk_nbytes=8 * MiB,
                    sink_factory=lambda p: ChunkedFileSink(p, window_nbytes=MiB, write_fn=slow_write))
    print("returned")
except KeyboardInterrupt:
    print("KeyboardInterrupt")
print("threads", sorted(t.name for t in threading.enumerate() if t.name.startswith("ptdstream")))
print("files", sorted(os.listdir(folder)))
victim = os.path.join(folder, "unrelated.txt")
fd = os.open(victim, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, b"hello")
time.sleep(1.5)  # an orphaned writer thread would write its piece into this fd now
os.close(fd)
print("unrelated", os.path.getsize(victim))
"""


def test_two_ctrl_c_during_a_slow_write_end_the_writer_before_its_fd_is_closed(tmp_path):
    """The second Ctrl-C comes while the save waits for the writer thread's write in
    progress: the save still waits for it, so the thread cannot write into a file
    that reuses the sink's descriptor number."""
    script = tmp_path / "slow_save.py"
    script.write_text(textwrap.dedent(SLOW_SAVE_TWO_CTRL_C))
    folder = tmp_path / "out"
    folder.mkdir()
    run = subprocess.run([sys.executable, str(script), str(folder)], capture_output=True, text=True, timeout=SAFETY_S,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # also in a background job
    assert run.stdout.splitlines() == [
        "KeyboardInterrupt",
        "threads []",
        "files []",
        "unrelated 5",
    ], run.stdout + run.stderr[-2000:]


def test_an_aborted_direct_sink_stops_its_io_threads_before_closing_its_fd(tmp_path):
    """O_DIRECT writes queued when a save fails: every one still goes to the temp
    file (closing the fd first would hand queued writes a closed or reused fd)."""
    import time

    seen = []

    def slow_pwrite(fd, view, offset):
        time.sleep(0.2)
        try:
            seen.append(os.fstat(fd).st_ino == inode)
        except OSError:
            seen.append(False)
        return os.pwrite(fd, view, offset)

    sink = ChunkedFileSink(str(tmp_path / "model.ptd"), direct=True, pwrite_fn=slow_pwrite)
    if not sink.direct:
        sink.abort()
        pytest.skip("the file system refuses O_DIRECT")
    inode = os.fstat(sink._fd).st_ino
    for _ in range(3):
        sink.write(bytes(8 << 20))  # three blocks queued behind slow writes
    sink.abort()
    assert seen and all(seen), seen
    assert [t.name for t in threading.enumerate() if t.name.startswith("ptdstream-direct")] == []
    assert os.listdir(tmp_path) == []
