"""Waiting for a helper thread that still uses a file descriptor, through Ctrl-C."""

from __future__ import annotations

import threading
from typing import Optional


def wait_through_interrupts(thread: threading.Thread, ended: threading.Event) -> Optional[KeyboardInterrupt]:
    """Wait until ``thread`` has ended, even while ``KeyboardInterrupt`` is raised in
    this thread; returns the last such interrupt (None if there was none).

    ``ended`` is an event the thread sets as the last thing it does (in a
    ``finally``). It is waited on rather than ``Thread.join``: CPython 3.11's
    ``join`` interrupted by Ctrl-C can mark a running thread as stopped
    (``_wait_for_tstate_lock`` releases the lock the running thread holds), after
    which ``is_alive()`` is False and ``join()`` returns at once.

    For threads that write to (or advise on) a file descriptor the caller is about
    to close: closing it while the thread still uses it would let the thread
    write into whatever file the number is given to next. The caller raises the
    interrupt again once it has cleaned up. The wait is for one write or one
    ``sync_file_range`` in progress: ptdstream's threads check for their stop
    signal between them.
    """
    interrupted: Optional[KeyboardInterrupt] = None
    while not ended.is_set():
        try:
            ended.wait()
        except KeyboardInterrupt as e:
            interrupted = e
    thread.join()  # it has left its target: only the interpreter's own clean-up is left
    return interrupted
