"""One helper for every collective step of a distributed write: the step runs on
every rank (or on rank 0) and a failure on any rank becomes one error raised on
every rank, naming each failed rank and its exception.

The model is torch's ``_DistWrapper`` (``torch/distributed/checkpoint/utils.py``):
``all_gather(step, fn)`` and ``broadcast(step, fn)`` run ``fn``, catch its
exception, exchange every rank's value or failure by an object collective and
raise the gathered failures (its ``CheckpointException``) on every rank. Here
each failure travels as its type name, message and whether it is an
:class:`~ptdstream.errors.IntegrityError` (an exception object may not pickle);
on the rank where it happened the original is the ``__cause__``. A
``KeyboardInterrupt`` or ``SystemExit`` is reported to the other ranks, then
re-raised where it happened.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import IntegrityError
from .errors import DistributedIntegrityError, DistributedWriteError

__all__ = ["Collective"]

T = TypeVar("T")
#: What one rank sends: ``("ok", value)`` or ``("error", "Type: message", is an IntegrityError)``.
_Report = tuple[Any, ...]


def _dist():
    import torch.distributed as dist

    return dist


class Collective:
    """The ranks of ``group`` (default: the default process group) running the
    steps of one write, each step a collective that every rank enters in the
    same order. Not thread-safe (one step at a time, as torch's collectives)."""

    def __init__(self, group=None) -> None:
        dist = _dist()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0

    def all_gather(self, step: str, fn: Callable[[], T]) -> list[T]:
        """Run ``fn`` on every rank; every rank's value in rank order, on every rank.

        Raises:
            DistributedWriteError: on every rank, when ``fn`` raised on any rank
                (:class:`DistributedIntegrityError` when each of those was an
                ``IntegrityError``) or the collective failed.
        """
        mine, error = _call(fn)
        gathered: list[Any] = [None] * self.world_size
        self._collective(step, error, lambda: _dist().all_gather_object(gathered, mine, group=self.group))
        self._raise_failures(step, dict(enumerate(gathered)), error)
        return [report[1] for report in gathered]

    def broadcast(self, step: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 only; its value on every rank.

        Raises:
            DistributedWriteError: on every rank, when ``fn`` raised on rank 0 or
                the collective failed.
        """
        mine, error = _call(fn) if self.rank == 0 else (None, None)
        box: list[Any] = [mine]
        self._collective(step, error, lambda: _dist().broadcast_object_list(box, src=self._root, group=self.group))
        self._raise_failures(step, {0: box[0]}, error)
        return box[0][1]

    def _collective(self, step: str, error: BaseException | None, call: Callable[[], None]) -> None:
        """Run the object collective; its own failure (a rank killed, a timeout)
        as :class:`DistributedWriteError`."""
        try:
            call()
        except Exception as e:  # noqa: BLE001 - any failure of the collective is re-raised as one error
            text = str(e).splitlines()[0] if str(e) else ""
            raise DistributedWriteError(step, {}, f"{type(e).__name__}: {text}") from (error or e)

    def _raise_failures(self, step: str, reports: dict[int, _Report], error: BaseException | None) -> None:
        if error is not None and not isinstance(error, Exception):
            raise error  # Ctrl-C or SystemExit here: the others were told
        failed = {rank: r for rank, r in reports.items() if r[0] == "error"}
        if failed:
            kind = DistributedIntegrityError if all(r[2] for r in failed.values()) else DistributedWriteError
            raise kind(step, {rank: r[1] for rank, r in failed.items()}) from error


def _call(fn: Callable[[], T]) -> tuple[_Report, BaseException | None]:
    try:
        return ("ok", fn()), None
    except BaseException as e:  # noqa: BLE001 - reported to every rank; re-raised here after the exchange
        text = f"{type(e).__name__}: {e}".removesuffix("; nothing was published")  # said once, at the end
        return ("error", text, isinstance(e, IntegrityError)), e
