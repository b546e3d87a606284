"""The errors of a distributed write: raised on every rank, naming each failed rank
(:class:`~ptdstream.distributed.collective.Collective` gathers them). Reachable from the
package root (``ptdstream.DistributedWriteError``)."""

from __future__ import annotations

from ..errors import IntegrityError, PtdstreamError

__all__ = ["DistributedIntegrityError", "DistributedWriteError"]


class DistributedWriteError(PtdstreamError):
    """A rank failed; raised on every rank, naming the step, each failed rank and
    its error. Nothing was published and the temp files are removed.

    Attributes:
        step: the step that failed: ``"describe the pieces"``, ``"fingerprint the
            dedup candidates"``, ``"plan the files"``, ``"write the pieces"`` or
            ``"publish"``.
        failures: ``{rank: "ExceptionType: message"}``; empty when the group
            itself failed (a rank killed, a timeout), which ``group_error`` names.
        published: ``False`` (nothing was published), ``True`` (rank 0 had
            published the whole set when the group failed) or ``None`` (this rank
            cannot know: the group failed while rank 0 was publishing).
    """

    def __init__(self, step: str, failures: dict[int, str], group_error: str | None = None,
                 published: bool | None = False) -> None:
        self.step = step
        self.failures = dict(failures)
        self.group_error = group_error
        self.published = published
        if group_error is not None:
            what = f"the group failed (a rank was killed, timed out or left): {group_error}"
        else:
            by_message: dict[str, list[int]] = {}
            for rank in sorted(self.failures):
                by_message.setdefault(self.failures[rank], []).append(rank)
            what = "; ".join(
                f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {message}"
                for message, ranks in by_message.items()
            )
        outcome = {False: "nothing was published", True: "rank 0 had published the whole set",
                   None: "rank 0 may have published the whole set: look in the folder"}[published]
        super().__init__(f"{step}: {what}; {outcome}")

    def __reduce__(self):
        return type(self), (self.step, self.failures, self.group_error, self.published)


class DistributedIntegrityError(DistributedWriteError, IntegrityError):
    """Every failed rank refused a source that changed after it was handed over
    (an :class:`~ptdstream.errors.IntegrityError` there): raised on every rank."""
