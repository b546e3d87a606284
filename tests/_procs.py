"""Forked children for the crash and concurrency tests."""

from __future__ import annotations

import os
import signal
import time
import traceback

import pytest


def fork(fn) -> int:
    """Run ``fn()`` in a forked child; it exits 0 when ``fn`` returns, 1 when it raises."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 1
        try:
            fn()
            code = 0
        except BaseException:  # noqa: BLE001 - the parent checks the exit code
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def wait_status(pid: int, timeout_s: float = 60.0) -> int:
    """The child's wait status (reaped, so its pid counts as dead); kills it and
    fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"child {pid} still running after {timeout_s} s")


def killed_at(n: int, fn) -> bool:
    """Run ``fn`` in a forked child killed by SIGKILL just before its ``n``-th publishing
    call (``ptdstream.system.fsops``' hook, 1-based); whether the kill happened (otherwise
    ``fn`` must have succeeded)."""
    from ptdstream.system import fsops

    def child():
        count = [0]

        def hook(op, path):
            count[0] += 1
            if count[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)

        fsops.set_hook(hook)
        fn()

    status = wait_status(fork(child), 60.0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.waitstatus_to_exitcode(status) == 0, f"the save killed at {n} failed on its own"
    return False
