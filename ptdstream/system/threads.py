"""Helper threads that use a file descriptor, and waiting for them through Ctrl-C."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["FdThread"]


class FdThread:
    """A daemon thread running ``target()`` that may write to (or advise on) a file
    descriptor its owner will close; :meth:`wait` waits for it through Ctrl-C.

    An event is set as the thread's last act and waited on rather than
    ``Thread.join``: CPython 3.11's ``join`` interrupted by Ctrl-C can mark a
    running thread as stopped (``_wait_for_tstate_lock`` releases the lock the
    running thread holds), after which ``is_alive()`` is False and ``join()``
    returns at once. Closing the descriptor while the thread still uses it would
    let the thread write into whatever file the number is given to next.
    """

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self._target = target
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._target()
        finally:
            self._ended.set()

    def is_alive(self) -> bool:
        """Whether the target has not returned yet."""
        return not self._ended.is_set()

    def wait(self) -> KeyboardInterrupt | None:
        """Wait until the thread has ended, even while ``KeyboardInterrupt`` is
        raised in this thread; returns the last such interrupt (None if none), for
        the caller to raise again once it has cleaned up. The wait is for one
        write or one ``sync_file_range`` in progress: ptdstream's threads check
        for their stop signal between them."""
        interrupted: KeyboardInterrupt | None = None
        while not self._ended.is_set():
            try:
                self._ended.wait()
            except KeyboardInterrupt as e:
                interrupted = e
        self._thread.join()  # it has left its target: only the interpreter's clean-up is left
        return interrupted
