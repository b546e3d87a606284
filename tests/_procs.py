"""Children of the tests: forked children (crash and concurrency tests), groups of
spawned ranks (distributed tests), each waited for on events and handshakes, with
one safety limit (:data:`SAFETY_S`) far above any honest run. Imports no pytest at
module level: spawned ranks import it."""

from __future__ import annotations

import os
import signal
import time
import traceback

#: The one wall-clock limit on a test's children (a process, a group of ranks, a subprocess):
#: far above any honest run on a loaded 2-core machine (load average 20), so that only a hang
#: reaches it, and the failure then names what was still running. A test waits on events and
#: handshakes, never on a limit sized for an idle box.
SAFETY_S = 1800.0


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


def wait_status(pid: int, timeout_s: float = SAFETY_S) -> int:
    """The child's wait status (reaped, so its pid counts as dead); kills it and
    fails the test after ``timeout_s`` (a safety limit: :data:`SAFETY_S`)."""
    import pytest

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"child {pid} still running after {timeout_s} s")


def rank_ready(folder: str, rank: int, world: int) -> None:
    """In a rank, once its imports are done and before its process group is made:
    say "imported, ready" (``folder/ready.rank<rank>``) and wait until every rank of
    ``world`` has, so that the group's timeout counts from a moment every rank has
    reached, however long the imports took on a loaded machine. No limit of its own:
    the parent's :func:`wait_ranks` ends a group that never gets ready."""
    os.makedirs(folder, exist_ok=True)
    mark = os.path.join(folder, f"ready.rank{rank}")
    with open(mark + ".tmp", "w"):
        pass
    os.replace(mark + ".tmp", mark)
    while not all(os.path.exists(os.path.join(folder, f"ready.rank{r}")) for r in range(world)):
        time.sleep(0.05)


def wait_ranks(procs, folder: str, safety_s: float = SAFETY_S) -> str | None:
    """Wait until every rank process of ``procs`` (``multiprocessing.Process``, rank
    ``i`` at index ``i``, each calling :func:`rank_ready` with ``folder``) has ended.
    A rank that ends before it was ready (its imports failed) ends the group at once;
    :data:`SAFETY_S` ends a group that hangs. Returns None, or what went wrong,
    naming the ranks still running and those ready (every rank is ended first)."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + safety_s
    problem = None
    while problem is None and any(p.exitcode is None for p in procs):
        left = deadline - time.monotonic()
        if left <= 0:
            running = [r for r, p in enumerate(procs) if p.exitcode is None]
            problem = f"ranks {running} still running after {safety_s:.0f} s"
            break
        wait([p.sentinel for p in procs if p.exitcode is None], timeout=min(left, 1.0))
        for r, p in enumerate(procs):
            p.join(0)
            if p.exitcode is not None and not os.path.exists(os.path.join(folder, f"ready.rank{r}")):
                problem = f"rank {r} ended (exit code {p.exitcode}) before it was ready (its imports)"
    if problem is not None:
        ready = [r for r in range(len(procs)) if os.path.exists(os.path.join(folder, f"ready.rank{r}"))]
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
        return f"{problem}; ready: {ready}; every rank ended"
    return None


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

    status = wait_status(fork(child), SAFETY_S)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.waitstatus_to_exitcode(status) == 0, f"the save killed at {n} failed on its own"
    return False
