"""Measurement helpers shared by the benchmarks (Linux only).

* :class:`RssSampler`: peaks of several memory fields over a run, and the
  ``VmRSS`` rise during chosen blocks (``window``).
* :class:`RssMonitor`: peak resident memory added during a block, in bytes, from
  two independent readings: the kernel's high-water mark (``VmHWM``, reset to
  the current RSS through ``/proc/self/clear_refs`` just before the block) and a
  thread sampling ``VmRSS`` every ~5 ms.
* :func:`resident_nbytes`: page-cache bytes a file holds now (``mincore`` on a
  read-only shared mapping; ``fincore --bytes`` if that fails).
* :func:`discard_file`: drop a file's cached pages (dirty ones included) and
  remove it, so the next run writes fresh blocks from a cold cache.
* :func:`xxh3_file`: xxh3-128 of a file, read in 8 MiB pieces.
* :func:`timeline_lines`: a save's per-stage timeline (``ptdstream.timeline``) as table lines.
* :func:`run_forked`: run a function in a forked child and return what it
  returns (pickled through a pipe); the child inherits the parent's memory
  copy-on-write, so objects built before the fork (an exported manager, a raw
  buffer) are there without being rebuilt or copied.

Nothing here allocates in proportion to a file's size except ``mincore``'s
vector (one byte per 4 KiB page).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any

MiB = 1 << 20
PIECE_NBYTES = 8 * MiB
PAGE_NBYTES = os.sysconf("SC_PAGE_SIZE")



# ---------------------------------------------------------------- memory


def status_kib(field: str, path: str = "/proc/self/status") -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``...), in KiB; with
    ``path="/proc/meminfo"``, a field of the machine's (``MemAvailable``...)."""
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(field.encode() + b":"):
                return int(line.split()[1])
    raise KeyError(f"{field} not in {path}")


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssMonitor:
    """Peak RSS added (bytes) between :meth:`start` and :meth:`stop`.

    Calls, in order: 1) ``start()`` (starts an :class:`RssSampler`, reads the
    baseline, resets ``VmHWM``) 2) the measured code 3) ``stop()``. After ``stop``:
    ``baseline_nbytes``, ``sampled_peak_nbytes`` (5 ms sampler), ``hwm_peak_nbytes``
    (kernel high-water mark; None where it cannot be reset) and
    ``added_nbytes`` = the larger of the two peaks minus the baseline.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self._sampler: RssSampler | None = None
        self._hwm_ok = False
        self.baseline_nbytes = 0
        self.sampled_peak_nbytes = 0
        self.hwm_peak_nbytes: int | None = None
        self.added_nbytes = 0

    def start(self) -> None:
        # Start the thread first: its stack and first sample are part of the
        # baseline, not of the measured block.
        self._sampler = RssSampler(interval_s=self.interval_s)
        time.sleep(3 * self.interval_s)
        self.baseline_nbytes = status_kib("VmRSS") * 1024
        self._sampler.peak["VmRSS"] = self.baseline_nbytes
        self._hwm_ok = reset_peak_rss()

    def stop(self) -> None:
        hwm_kib = status_kib("VmHWM") if self._hwm_ok else None
        self.sampled_peak_nbytes = self._sampler.stop()["VmRSS"]
        self.hwm_peak_nbytes = hwm_kib * 1024 if hwm_kib is not None else None
        peak = max(self.sampled_peak_nbytes, self.hwm_peak_nbytes or 0)
        self.added_nbytes = max(0, peak - self.baseline_nbytes)


class RssSampler:
    """Peaks of ``/proc/self/status`` memory fields (bytes), sampled every ~5 ms
    from construction until :meth:`stop`, plus per-block rises (:meth:`window`).

    ``peak``: ``{field: largest value seen}`` for ``fields`` (``VmRSS`` first);
    ``window(record)`` sets ``record["seconds"]`` and ``record["rss_added"]``
    (largest ``VmRSS`` during the block minus ``VmRSS`` at its start);
    ``mark(stage)`` starts a named stage: ``stages`` is ``{stage: {field:
    largest value seen while it was the current one}}``, in the order marked.
    """

    def __init__(self, fields: Iterable[str] = ("VmRSS",), interval_s: float = 0.005) -> None:
        self.fields = tuple(fields)
        self.interval_s = interval_s
        self.peak = {f: 0 for f in self.fields}
        self.stages: dict[str, dict[str, int]] = {}
        self._stage: dict[str, int] | None = None
        self._window_peak = 0
        self._stop = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        stage = self._stage
        for field in self.fields:
            value = status_kib(field) * 1024
            self.peak[field] = max(self.peak[field], value)
            if stage is not None:
                stage[field] = max(stage[field], value)
        self._window_peak = max(self._window_peak, status_kib("VmRSS") * 1024)

    def mark(self, stage: str) -> None:
        """Begin ``stage`` (the current one ends): later samples count in ``stages[stage]``."""
        self._sample()  # the last sample of the stage that ends
        record = self.stages.setdefault(stage, {f: 0 for f in self.fields})
        self._stage = record
        self._sample()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    @contextmanager
    def window(self, record: dict):
        start = status_kib("VmRSS") * 1024
        self._window_peak = start
        t = time.perf_counter()
        try:
            yield
        finally:
            record["seconds"] = time.perf_counter() - t
            record["rss_added"] = max(self._window_peak, status_kib("VmRSS") * 1024) - start

    def stop(self) -> dict:
        """Stop sampling; the peaks, one last sample included."""
        self._sample()
        self._stop.set()
        self._thread.join()
        return dict(self.peak)


# ---------------------------------------------------------------- page cache


def _resident_mincore(path: str) -> int:
    from ptdstream.system.pagecache import resident_nbytes as _mincore

    return _mincore(path)


def _resident_fincore(path: str) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", path],
        check=True, capture_output=True, text=True,
    ).stdout
    return int(out.split()[0])


def resident_nbytes(path: str) -> int:
    """Bytes of ``path`` in the page cache now (mincore; fincore as a fallback)."""
    try:
        return _resident_mincore(path)
    except OSError:
        return _resident_fincore(path)


def files_under(folder: str) -> list[str]:
    """Every regular file under ``folder`` (temp files included), sorted."""
    found = []
    for root, _dirs, names in os.walk(folder):
        found.extend(os.path.join(root, n) for n in names)
    return sorted(p for p in found if os.path.isfile(p))


def fsync_files(folder: str) -> None:
    """fsync every file under ``folder`` (what upstream's writers leave unsynced)."""
    for path in files_under(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def upstream_save(manager: Any, out: str) -> None:
    """Upstream's save of ``manager`` into ``out``: ``write_to_file`` into ``model.pte``,
    ``write_tensor_data_to_file``, then every file fsynced (as ``ptdstream.save`` does)."""
    with open(os.path.join(out, "model.pte"), "wb") as f:
        manager.write_to_file(f)
    manager.write_tensor_data_to_file(out)
    fsync_files(out)


def file_digests(folder: str) -> dict[str, tuple[int, str]]:
    """``{file name: (bytes, xxh3-128 hex)}`` of every file under ``folder``."""
    return {os.path.basename(p): (os.path.getsize(p), xxh3_file(p)) for p in files_under(folder)}


def record_peaks(res: dict, peaks: dict) -> None:
    """``res["peak_rss"]`` (the larger of the sampled ``VmRSS`` and ``VmHWM``), ``res["peak_anon"]``
    and ``res["peak_file"]`` from an :class:`RssSampler`'s ``stop()`` (fields ``VmRSS``,
    ``RssAnon``, ``RssFile``), in bytes."""
    res["peak_rss"] = max(peaks["VmRSS"], status_kib("VmHWM") * 1024)
    res["peak_anon"], res["peak_file"] = peaks["RssAnon"], peaks["RssFile"]


def digests_then_discard(folder: str) -> dict[str, tuple[int, str]]:
    """:func:`file_digests` of ``folder``, then every file there discarded (:func:`discard_file`)."""
    digests = file_digests(folder)
    for p in files_under(folder):
        discard_file(p)
    return digests


def discard_file(path: str) -> None:
    """Drop every cached page of ``path`` and remove it.

    Truncating to 0 drops the file's pages from the page cache, dirty ones
    included, without writing them back (``POSIX_FADV_DONTNEED`` alone would
    start writeback of dirty pages, which would then compete with the next
    run); the fadvise that follows is the documented drop for whatever is left.
    """
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, 0)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    os.unlink(path)


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- machine noise


def device_written_nbytes(path: str) -> int | None:
    """Bytes written so far to the block device holding ``path`` (``/sys/dev/block``)."""
    st = os.stat(path)
    try:
        with open(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat") as f:
            return int(f.read().split()[6]) * 512  # field 7: sectors written
    except (OSError, IndexError, ValueError):
        return None


def loadavg1() -> float:
    """The 1-minute load average (2 cores here: > 1 means someone else is busy too)."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def busy_cores(window_s: float = 0.25) -> float:
    """CPUs busy (all processes) over the next ``window_s`` seconds, from ``/proc/stat``."""
    busy0, total0 = _cpu_times()
    time.sleep(window_s)
    busy1, total1 = _cpu_times()
    ncpu = os.cpu_count() or 1
    return ncpu * (busy1 - busy0) / max(1, total1 - total0)


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.3) -> tuple[float, float]:
    """Wait (at most ``max_wait_s``) until other processes use < ``threshold_cores`` CPUs.

    Call it while this process is idle. Returns ``(seconds waited, busy cores last seen)``.
    """
    start = time.perf_counter()
    busy = busy_cores()
    while busy >= threshold_cores and time.perf_counter() - start < max_wait_s:
        busy = busy_cores()
    return time.perf_counter() - start, busy


# ---------------------------------------------------------------- hashing


def xxh3_file(path: str, piece_nbytes: int = PIECE_NBYTES) -> str:
    """xxh3-128 hex digest of the file at ``path`` (read in pieces; pages dropped after)."""
    import xxhash

    digest = xxhash.xxh3_128()
    buf = bytearray(piece_nbytes)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            n = os.readv(fd, [buf])
            if n == 0:
                break
            digest.update(view[:n])
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return digest.hexdigest()


# ---------------------------------------------------------------- processes


class ChildError(RuntimeError):
    """The forked child raised; the message holds its traceback."""


def run_forked(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` in a forked child; return its (picklable) result.

    The child exits with ``os._exit`` (no atexit handlers, no buffers flushed
    twice). A child exception is raised here as :class:`ChildError`.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        code = 0
        try:
            try:
                payload = pickle.dumps(("ok", fn(*args, **kwargs)))
            except BaseException:  # noqa: BLE001 - everything goes back to the parent
                payload = pickle.dumps(("error", traceback.format_exc()))
                code = 1
            with os.fdopen(write_fd, "wb") as f:
                f.write(payload)
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise ChildError(f"child {pid} died without a result (wait status {status})")
    kind, value = pickle.loads(data)
    if kind != "ok":
        raise ChildError(value)
    return value


def median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of nothing")
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def write_all(fd: int, view: memoryview) -> None:
    """``os.write`` until every byte of ``view`` is written."""
    done = 0
    while done < len(view):
        n = os.write(fd, view[done:])
        if n <= 0:
            raise OSError(f"write returned {n} with {len(view) - done} bytes left")
        done += n


def raw_write_fsync(path: str, nbytes: int, buf: memoryview) -> float:
    """Seconds to write ``nbytes`` bytes (``buf`` repeated) to a new ``path`` and fsync
    it: the raw baseline every benchmark compares with. The file is left for the caller."""
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            n = min(len(buf), left)
            write_all(fd, buf[:n])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def timeline_lines(timeline: dict, indent: str = "    ") -> list[str]:
    """One line per stage: busy seconds, share of the save's wall time, GB/s."""
    wall = timeline["wall_seconds"]
    lines = [f"{indent}{'stage':<52} {'busy s':>7} {'% wall':>7} {'GiB':>7} {'GB/s':>7} {'calls':>7}"]
    for name, st in sorted(timeline["stages"].items(), key=lambda kv: -kv[1]["seconds"]):
        rate = f"{st['GBps']:.2f}" if st["GBps"] else "-"
        lines.append(f"{indent}{name:<52} {st['seconds']:>7.2f} {100 * st['seconds'] / wall:>6.1f}% "
                     f"{st['nbytes'] / 2**30:>7.2f} {rate:>7} {st['calls']:>7}")
    lines.append(f"{indent}{'save wall time':<52} {wall:>7.2f}")
    return lines
