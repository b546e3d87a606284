"""Scoped, thread-safe patches of executorch and torch: the one patching mechanism.

Every change ptdstream makes to upstream code goes through :func:`shadowed`: a
name set while a context is active and restored when the last one exits. A
process-wide switch (:func:`ptdstream.install`) is a context entered once and
kept on a :class:`Scope` until :meth:`Scope.close`. Nothing stays changed after the
contexts exit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Scope", "is_shadowed", "shadowed"]

_lock = threading.Lock()
_shadows: dict[tuple[int, str], list] = {}  # (id(owner), name) -> [count, had_own, original]


@contextlib.contextmanager
def shadowed(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``owner.name = value`` (a module global or a class attribute) while any
    context for it is active.

    The first entry sets it, the last exit restores the original (or removes the
    name when ``owner`` did not define it itself). Entering again while active
    keeps the first value. Thread-safe; exits may happen in any thread and in any
    order.
    """
    key = (id(owner), name)
    with _lock:
        entry = _shadows.get(key)
        if entry is None:
            had_own = name in vars(owner)
            entry = _shadows[key] = [0, had_own, vars(owner).get(name)]
            setattr(owner, name, value)
        entry[0] += 1
    try:
        yield
    finally:
        with _lock:
            entry[0] -= 1
            if entry[0] == 0:
                del _shadows[key]
                if entry[1]:
                    setattr(owner, name, entry[2])
                else:
                    delattr(owner, name)


def is_shadowed(owner: Any, name: str) -> bool:
    """Whether a :func:`shadowed` context for ``owner.name`` is active."""
    with _lock:
        return (id(owner), name) in _shadows


class Scope:
    """Contexts kept open until :meth:`close`: the long-lived form of :func:`shadowed`.

    ``open(factory)`` enters ``factory()`` unless this scope is already open (then
    it does nothing). Thread-safe; ``close`` is idempotent.
    """

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Whether the scope is open."""
        return self._stack is not None

    def open(self, factory) -> None:
        """Enter ``factory()`` and keep it open until :meth:`close`, unless the scope is open already."""
        with self._lock:
            if self._stack is not None:
                return
            stack = contextlib.ExitStack()
            stack.enter_context(factory())
            self._stack = stack

    def close(self) -> None:
        """Exit what :meth:`open` entered, if anything (idempotent)."""
        with self._lock:
            stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
