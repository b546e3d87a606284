"""Peak resident set size of this process while a block runs (the demo's memory figure)."""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["PeakRssSampler"]


class PeakRssSampler:
    """Context manager: the peak resident set size added while it is entered.

    A daemon thread reads ``/proc/self/statm`` every ``interval_s`` seconds (plus
    once on enter and once on exit); ``added_nbytes`` is the peak minus the value
    on enter, in bytes. Where ``/proc`` is missing it falls back to
    ``resource.getrusage`` ``ru_maxrss`` before/after, which only shows growth
    above the process's earlier lifetime peak (``method`` says which was used).
    A peak held for less than ``interval_s``, or inside one call that keeps the
    GIL, can be missed; the save loop releases the GIL on every write. Not
    reentrant; use one instance per measured region.
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.added_nbytes = 0
        self.samples = 0
        self._use_proc = os.path.exists("/proc/self/statm")
        self.method = (
            f"/proc/self/statm sampled every {interval_s * 1e3:g} ms by a background thread"
            if self._use_proc
            else "resource.getrusage ru_maxrss before/after (growth above earlier peak only)"
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._baseline = 0
        self._peak = 0

    @staticmethod
    def _rss_nbytes() -> int:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    @staticmethod
    def _maxrss_nbytes() -> int:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # macOS bytes, Linux KiB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def _sample(self) -> None:
        self._peak = max(self._peak, self._rss_nbytes())
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakRssSampler:
        if self._use_proc:
            self._baseline = self._peak = self._rss_nbytes()
            self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
            self._thread.start()
        else:
            self._baseline = self._maxrss_nbytes()
        return self

    def __exit__(self, *exc) -> None:
        if self._use_proc:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            self._sample()
        else:
            self._peak = self._maxrss_nbytes()
        self.added_nbytes = max(0, self._peak - self._baseline)
