"""Progress reporting for long operations: a tqdm bar or a caller's callback."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

__all__ = ["progress_callback"]


def progress_callback(
    stack: contextlib.ExitStack, progress: Any, total_nbytes: int, desc: str
) -> Callable[[int], object]:
    """A function to call with the bytes done after each piece.

    ``progress`` is ``True`` (a tqdm bar on stderr, closed when ``stack`` closes),
    a callable (returned as is) or anything false (a function that does nothing).
    """
    if progress is True:
        from tqdm import tqdm

        bar = stack.enter_context(tqdm(total=total_nbytes, unit="B", unit_scale=True, desc=desc))
        return bar.update
    return progress if callable(progress) else _nothing


def _nothing(nbytes: int) -> None:
    return None
