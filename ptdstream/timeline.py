"""Per-stage timeline of a save: where the seconds go between the GPU and the disk.

Off by default (every instrumented place checks :func:`stage_timeline` once per
piece and does nothing when it is ``None``). Inside :func:`record_stages` each
stage adds its busy seconds and bytes: the CUDA source's device-to-host waits,
hashing, hand-offs to the writer thread, the sink's writes, staging copies and
O_DIRECT writes (per I/O thread), writeback waits, fsync and publish. Stages run
in several threads and overlap: a stage's seconds are its own busy time, and the
slowest stage close to the save's wall time is the bottleneck.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

__all__ = ["StageTimeline", "record_stages", "stage_timeline"]

_current: StageTimeline | None = None


class StageTimeline:
    """Busy seconds, bytes and calls per stage name; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stages: dict[str, list[float]] = {}
        self.started = time.perf_counter()
        self.wall_seconds = 0.0

    def add(self, stage: str, seconds: float, nbytes: int = 0) -> None:
        """Add ``seconds`` of busy time and ``nbytes`` bytes to ``stage``."""
        with self._lock:
            entry = self.stages.setdefault(stage, [0.0, 0, 0])
            entry[0] += seconds
            entry[1] += nbytes
            entry[2] += 1

    def to_dict(self) -> dict:
        """``{"wall_seconds": s, "stages": {name: {"seconds", "nbytes", "calls", "GBps"}}}``."""
        with self._lock:
            stages = {
                name: {
                    "seconds": s,
                    "nbytes": int(n),
                    "calls": int(c),
                    "GBps": (n / s / 1e9) if s > 0 and n else None,
                }
                for name, (s, n, c) in self.stages.items()
            }
        return {"wall_seconds": self.wall_seconds, "stages": stages}


def stage_timeline() -> StageTimeline | None:
    """The timeline being recorded, or ``None`` (the default: nothing is recorded)."""
    return _current


@contextlib.contextmanager
def record_stages() -> Iterator[StageTimeline]:
    """Record a per-stage timeline of what runs inside (one at a time per process)."""
    global _current
    previous = _current
    timeline = _current = StageTimeline()
    try:
        yield timeline
    finally:
        timeline.wall_seconds = time.perf_counter() - timeline.started
        _current = previous
