"""Progress reporting for long operations: a tqdm bar or a caller's callback.

One contract for every public function that writes or reads at length
(``save``, ``write_data_files``, ``write_ptd``, ``pack``, ``unpack``,
``compare_files``, ``ptdstream.distributed.write_data_files``): ``progress`` is
``True`` (a tqdm bar on stderr), ``False`` or ``None`` (nothing), or a callable
called with the bytes of each piece as it is done (its return value ignored).
Anything else is refused before any work starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from .errors import ArgumentTypeError

__all__ = ["check_progress", "progress_callback"]


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
