"""Progress reporting for long operations: a tqdm bar or a caller's callback, and
the stages of a long export.

One contract for every public function that writes or reads at length
(``save``, ``write_data_files``, ``write_ptd``, ``pack``, ``unpack``,
``compare_files``, ``ptdstream.distributed.write_data_files``): ``progress`` is
``True`` (a tqdm bar on stderr), ``False`` or ``None`` (nothing), or a callable
called with the bytes of each piece as it is done (its return value ignored).
Anything else is refused before any work starts.

:class:`Stages` prints the stages of work that is not counted in bytes (an
export: load, ``torch.export`` of each method, lowering, save), one line as each
begins and one with its seconds as it ends: ``ptdstream demo`` and the Hugging
Face export (``ptdstream.hf``) print theirs with it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from .errors import ArgumentTypeError

__all__ = ["Stages", "check_progress", "progress_callback"]


def check_progress(progress: Any) -> None:
    """Refuse a ``progress`` argument outside the contract.

    Raises:
        ArgumentTypeError: (a ``TypeError``) ``progress`` is not ``True``,
            ``False``, ``None`` or a callable; names the value given.
    """
    if progress is True or progress is False or progress is None or callable(progress):
        return
    raise ArgumentTypeError(
        f"progress={progress!r} ({type(progress).__name__}): pass True for a bar on stderr, "
        "False or None for none, or a callable taking the bytes of each piece"
    )


def progress_callback(
    stack: contextlib.ExitStack, progress: Any, total_nbytes: int | None, desc: str
) -> Callable[[int], object]:
    """A function to call with the bytes done after each piece.

    ``progress`` is ``True`` (a tqdm bar on stderr of ``total_nbytes`` bytes, a
    count when None: a size not known in advance; closed when ``stack`` closes),
    a callable (returned as is), or ``False`` / ``None`` (a function that does
    nothing).

    Raises:
        ArgumentTypeError: any other ``progress`` (:func:`check_progress`).
    """
    check_progress(progress)
    if progress is True:
        from tqdm import tqdm

        bar = stack.enter_context(tqdm(total=total_nbytes, unit="B", unit_scale=True, desc=desc))
        return bar.update
    return progress if callable(progress) else _nothing


def _nothing(nbytes: int) -> None:
    return None


class Stages:
    """Prints each stage of a long operation on ``stream`` as it begins (``[2/5] lower
    ...``) and as it ends (``[2/5] lower ...: done in 22.6 s``), with, given
    ``elapsed``, the seconds since the first stage began; silent when ``stream`` is
    None. ``total``: the number of stages, when known (else ``[2]``).

    Stages follow one another: :meth:`begin` ends the current one (an export whose
    next stage is known only when it starts), :meth:`stage` is a block, :meth:`end`
    ends the current one, :meth:`abandon` drops it without a line (it failed: the
    error says so). Not thread-safe.
    """

    def __init__(self, stream: TextIO | None, total: int | None = None, *, elapsed: bool = False) -> None:
        self.stream, self.total, self.elapsed, self.count = stream, total, elapsed, 0
        self._current: tuple[str, float, str] | None = None
        self._started: float | None = None

    def begin(self, what: str) -> None:
        """End the current stage, if any, and begin ``what``."""
        self.end()
        self.count += 1
        now = time.perf_counter()
        if self._started is None:
            self._started = now
        tag = f"[{self.count}/{self.total}]" if self.total else f"[{self.count}]"
        self._current = (what, now, tag)
        self._say(f"{tag} {what} ...")

    def end(self) -> None:
        """End the current stage (its line with its seconds); nothing when none is."""
        if self._current is None:
            return
        (what, start, tag), self._current = self._current, None
        now = time.perf_counter()
        total = f" ({now - (self._started or start):.1f} s in all)" if self.elapsed else ""
        self._say(f"{tag} {what}: done in {now - start:.1f} s{total}")

    def abandon(self) -> None:
        """Drop the current stage without its line (it raised)."""
        self._current = None

    @contextlib.contextmanager
    def stage(self, what: str) -> Iterator[None]:
        """A stage around the block: its line, then (if the block returns) its seconds."""
        self.begin(what)
        try:
            yield
        except BaseException:
            self.abandon()
            raise
        self.end()

    def _say(self, line: str) -> None:
        if self.stream is not None:
            print(line, file=self.stream, flush=True)
