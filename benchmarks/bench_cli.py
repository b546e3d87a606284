#!/usr/bin/env python
"""Benchmark the read commands: ``verify`` and ``inspect`` start to finish on small files,
and ``verify --against`` of two large files against ``cat``/``dd`` of the same files.

Part 1, small files (targets: <= 0.5 s and <= 64 MiB peak RSS). Three small real exports
(fixed seed; made here with torch, before anything is timed): an MLP (portable), the same
lowered to XNNPACK, and the MLP with its weights in a .ptd. Each command runs as a fresh
process under ``/usr/bin/time`` (peak RSS of that process, ``%M``); the wall time is
measured around it. After one warm-up run, the median and the minimum of ``--runs``
runs are printed (the minimum is the better estimate on a shared, loaded machine). Rows:

  ptdstream verify / inspect   ``python -m ptdstream ...``, the command a user types
  check_structure (library)    ``python -c`` importing only ``ptdstream.check.structure``
  upstream load_program        ``executorch.runtime``: load_program + load_method of every
                               method (what ``verify`` answers without the runtime)
  python -c pass               the interpreter alone: the floor of any Python command

Part 2, large files (target: ``verify --against`` >= 0.9x the speed of ``cat`` of the same
two files, cold cache). Two equal files of ``--gib`` GiB each (a 64 MiB random block
repeated; written, fsynced, then every page dropped). Before every timed run both files'
pages are dropped (``POSIX_FADV_DONTNEED``), so each run reads from the disk. Rows:
``ptdstream verify A --against B`` (streams both side by side in 8 MiB pieces),
``cat A B > /dev/null`` and ``dd`` of each file in turn (bs=8M); ratio = cat's time /
the row's time (>= 1.0 means at least as fast as cat).

Usage:
    python benchmarks/bench_cli.py                  # small files, 5 runs; 2 x 4 GiB
    python benchmarks/bench_cli.py --gib 1 --runs 3 # smaller disk footprint
    python benchmarks/bench_cli.py --gib 0          # small files only

Exit status: 0 when every run succeeded (targets are reported, not enforced), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from _measure import MiB, median  # noqa: E402 - after the sys.path entries that find it

GiB = 1 << 30
PY = sys.executable


def _exports(folder: str) -> dict[str, tuple[str, ...]]:
    """Three small exports: {name: (pte, [ptd])}. Imports torch (not timed)."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from conftest import Mlp, export
    from executorch.exir import ExecutorchBackendConfig

    out = {}
    for name, kwargs in (("mlp", {}), ("mlp-xnnpack", {"xnnpack": True}),
                         ("mlp-external", {"config": ExecutorchBackendConfig(external_constants=True)})):
        torch.manual_seed(0)
        manager = export(Mlp(), **kwargs)
        sub = os.path.join(folder, name)
        os.makedirs(sub)
        pte = os.path.join(sub, "model.pte")
        with open(pte, "wb") as f:
            manager.write_to_file(f)
        ptds = ()
        if manager._tensor_data:
            manager.write_tensor_data_to_file(sub)
            ptds = tuple(os.path.join(sub, n) for n in sorted(os.listdir(sub)) if n.endswith(".ptd"))
        out[name] = (pte,) + ptds
    return out


def timed(cmd: Sequence[str], stdout=subprocess.DEVNULL) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit code) of ``cmd`` as its own process."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as t:
        start = time.perf_counter()
        rc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", t.name, *cmd], stdout=stdout,
                            stderr=subprocess.DEVNULL).returncode
        wall = time.perf_counter() - start
        lines = [line for line in open(t.name).read().split() if line.isdigit()]
    return wall, int(lines[-1]) * 1024 if lines else 0, rc


def small(files: dict[str, tuple[str, ...]], runs: int) -> list[tuple[str, str, float, float, int, bool]]:
    rows = []
    lib = ("import sys; from ptdstream.check.structure import check_structure; "
           "sys.exit(0 if check_structure(sys.argv[1], sys.argv[2:]).ok else 1)")
    upstream = ("import sys; from executorch.runtime import Runtime; "
                "p = Runtime.get().load_program(sys.argv[1], data_path=(sys.argv[2] if len(sys.argv) > 2 else None)); "
                "[p.load_method(m) for m in p.method_names]")
    for name, paths in files.items():
        cases = [
            ("ptdstream verify", [PY, "-m", "ptdstream", "verify", *paths]),
            ("ptdstream inspect", [PY, "-m", "ptdstream", "inspect", *paths]),
            ("check_structure (library)", [PY, "-c", lib, *paths]),
            ("upstream load_program", [PY, "-c", upstream, *paths]),
            ("python -c pass", [PY, "-c", "pass"]),
        ]
        for label, cmd in cases:
            timed(cmd)  # warm-up (file cache of the interpreter and modules), not counted
            walls, rss, ok = [], [], True
            for _ in range(runs):
                wall, peak, rc = timed(cmd)
                walls.append(wall)
                rss.append(peak)
                ok &= rc == 0
            rows.append((name, label, median(walls), min(walls), max(rss), ok))
    return rows


def _drop(paths: Sequence[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _make_large(folder: str, nbytes: int) -> tuple[str, str]:
    block = os.urandom(64 * MiB)
    paths = (os.path.join(folder, "a.bin"), os.path.join(folder, "b.bin"))
    for p in paths:
        with open(p, "wb") as f:
            left = nbytes
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())
    _drop(paths)
    return paths


def large(folder: str, nbytes: int, runs: int) -> list[tuple[str, float, bool]]:
    a, b = _make_large(folder, nbytes)
    cases = [
        ("ptdstream verify A --against B", [PY, "-m", "ptdstream", "verify", a, "--against", b]),
        ("cat A B > /dev/null", ["cat", a, b]),
        ("dd A; dd B (bs=8M)", ["sh", "-c", f"dd if={a} of=/dev/null bs=8M status=none && "
                                              f"dd if={b} of=/dev/null bs=8M status=none"]),
    ]
    times: dict[str, list[float]] = {label: [] for label, _ in cases}
    ok: dict[str, bool] = {label: True for label, _ in cases}
    for r in range(runs):
        for label, cmd in (cases if r % 2 == 0 else cases[::-1]):  # alternate the order
            _drop((a, b))
            wall, _, rc = timed(cmd)
            times[label].append(wall)
            ok[label] &= rc == 0
    for p in (a, b):
        os.remove(p)
    return [(label, median(times[label]), ok[label]) for label, _ in cases]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per command (median reported)")
    ap.add_argument("--gib", type=float, default=4.0, help="size of each large file in GiB (0: skip part 2)")
    ap.add_argument("--dir", default=None, help="folder for the large files (default: a temp folder)")
    args = ap.parse_args(argv)
    all_ok = True
    work = tempfile.mkdtemp(prefix="bench_cli-", dir=args.dir)
    try:
        files = _exports(os.path.join(work, "small"))
        print(f"Part 1: small files, median of {args.runs} runs, each a fresh process")
        print(f"{'file':<14} {'command':<28} {'median s':>9} {'min s':>7} {'peak RSS MiB':>13} {'vs floor':>9}  ok")
        rows = small(files, args.runs)
        floor = {name: wall for name, label, wall, _, _, _ in rows if label == "python -c pass"}
        for name, label, wall, best, rss, ok in rows:
            all_ok &= ok
            print(f"{name:<14} {label:<28} {wall:9.3f} {best:7.3f} {rss / MiB:13.1f} {wall / floor[name]:8.1f}x  "
                  f"{'yes' if ok else 'NO'}")
        verify = [r for r in rows if r[1] in ("ptdstream verify", "ptdstream inspect")]
        print(f"targets: median wall <= 0.5 s: {all(r[2] <= 0.5 for r in verify)}; "
              f"peak RSS <= 64 MiB: {all(r[4] <= 64 * MiB for r in verify)} "
              f"(load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
        if args.gib > 0:
            nbytes = int(args.gib * GiB)
            print(f"\nPart 2: two files of {nbytes / GiB:g} GiB, cold cache, median of {args.runs} runs")
            rows2 = large(work, nbytes, args.runs)
            cat = next(t for label, t, _ in rows2 if label.startswith("cat"))
            print(f"{'command':<34} {'wall s':>8} {'GB/s':>7} {'vs cat':>7}  ok")
            for label, t, ok in rows2:
                all_ok &= ok
                print(f"{label:<34} {t:8.2f} {2 * nbytes / t / 1e9:7.2f} {cat / t:6.2f}x  {'yes' if ok else 'NO'}")
            ours = next(t for label, t, _ in rows2 if label.startswith("ptdstream"))
            print(f"target: verify --against >= 0.9x cat: {cat / ours >= 0.9} ({cat / ours:.2f}x)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
