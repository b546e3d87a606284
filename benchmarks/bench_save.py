#!/usr/bin/env python
"""Benchmark ``ptdstream.save`` against executorch's own writer and a raw write.

Two cases, exported once each from the same deterministic fp32 MLP (a stack of
``nn.Linear``, portable ops, no delegate):

  A  ``ExecutorchBackendConfig(external_constants=True)``: weights in a .ptd
  B  default config: weights in the .pte's constant segment

Each measurement runs in a child forked after the export (the manager is built
and shared copy-on-write; the RSS baseline is taken in the child just before
the save):

  ptdstream       ``ptdstream.save(manager, path)`` (temp files, fsync, rename)
  upstream        ``manager.write_to_file(f)`` + ``manager.write_tensor_data_to_file(dir)``
                  as they are (no fsync: the data may still be in the page cache)
  upstream+fsync  the same, then fsync of every file written (durable, like ptdstream)
  raw             the same number of bytes written to one file in 8 MiB pieces from
                  a buffer that exists before the fork, then fsync

Between runs every output file is truncated, its pages dropped
(``POSIX_FADV_DONTNEED``) and removed, so each run writes fresh files from a
cold cache. Methods are interleaved (the order rotates each repeat); before each
run the driver waits up to ``--quiet-wait-s`` for other processes to go idle.
The table shows medians; byte identity is checked with xxh3-128 of the files.
See benchmarks/README.md for the method and its caveats.

Usage:
    python benchmarks/bench_save.py                      # 1.5 GiB, 3 repeats
    python benchmarks/bench_save.py --size-gib 0.2 --repeats 1
    python benchmarks/bench_save.py --json bench.json --out /data/scratch

Exit status: 0 all targets passed, 1 a target failed, 2 usage or setup error.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import (
    PIECE_NBYTES,
    ChildError,
    MiB,
    RssMonitor,
    device_written_nbytes,
    discard_file,
    files_under,
    fsync_dir,
    loadavg1,
    median,
    resident_nbytes,
    run_forked,
    wait_for_quiet,
    write_all,
    xxh3_file,
)

GiB = 1 << 30
METHODS = ("ptdstream", "upstream", "upstream+fsync", "raw")
CASES = (
    ("A", "weights in .ptd (external_constants=True)", True),
    ("B", "weights in .pte", False),
)
SCRATCH_MARK = ".bench_save-scratch"

# Targets (ptdstream only).
MIN_RATIO_VS_RAW = 0.95
MAX_RSS_ADDED_NBYTES = 64 * MiB
MAX_PAGE_CACHE_NBYTES = 128 * MiB  # two 64 MiB drop windows


# ---------------------------------------------------------------- model and export


def build_model(size_gib: float, width: int, seed: int):
    """A stack of ``nn.Linear(width, width)`` holding about ``size_gib`` GiB of fp32."""
    import torch
    from torch import nn

    layer_nbytes = (width * width + width) * 4
    n_layers = max(1, round(size_gib * GiB / layer_nbytes))
    torch.manual_seed(seed)
    with torch.no_grad():
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(n_layers)]).eval()
    example = (torch.randn(1, width),)
    return model, example, n_layers, n_layers * layer_nbytes


def export_manager(model, example, external_constants: bool):
    """torch.export -> to_edge_transform_and_lower -> to_executorch."""
    import torch
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    exported = torch.export.export(model, example)
    edge = to_edge_transform_and_lower(exported)
    return edge.to_executorch(ExecutorchBackendConfig(external_constants=external_constants))


def expected_nbytes(manager) -> tuple[int, dict[str, int]]:
    """Bytes upstream writes: the .pte Cord plus every ``<tag>.ptd`` Cord (no joining)."""
    files = {"model.pte": len(manager._pte_data)}
    for tag, cord in (manager._tensor_data or {}).items():
        files[tag if tag.endswith(".ptd") else tag + ".ptd"] = len(cord)
    return sum(files.values()), files


def filled_buffer(nbytes: int, seed: int) -> bytearray:
    """``nbytes`` of pseudo-random bytes, every page touched (not the shared zero page)."""
    import torch

    buf = bytearray((nbytes + 7) // 8 * 8)
    gen = torch.Generator().manual_seed(seed)
    torch.frombuffer(buf, dtype=torch.int64).random_(generator=gen)
    return buf


# ---------------------------------------------------------------- one measured run (child)


def measured_run(method: str, run_dir: str, manager, raw_view, raw_nbytes: int) -> dict[str, Any]:
    """Runs in the forked child: time ``method``, its peak RSS added, its page cache after."""
    gc.disable()  # nothing is collected mid-run; gc would also dirty shared pages
    pte_path = os.path.join(run_dir, "model.pte")
    extra: dict[str, Any] = {}
    monitor = RssMonitor(interval_s=0.005)
    monitor.start()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    if method == "ptdstream":
        import ptdstream

        report = ptdstream.save(manager, pte_path)
        extra["plan_seconds"] = report.plan_seconds
        extra["reported_nbytes"] = report.nbytes
    elif method in ("upstream", "upstream+fsync"):
        with open(pte_path, "wb") as f:
            manager.write_to_file(f)
        manager.write_tensor_data_to_file(run_dir)
        if method == "upstream+fsync":
            for name in sorted(os.listdir(run_dir)):
                fd = os.open(os.path.join(run_dir, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    elif method == "raw":
        fd = os.open(os.path.join(run_dir, "raw.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for offset in range(0, raw_nbytes, PIECE_NBYTES):
                write_all(fd, raw_view[offset : min(offset + PIECE_NBYTES, raw_nbytes)])
            os.fsync(fd)
        finally:
            os.close(fd)
    else:
        raise ValueError(f"unknown method {method!r}")
    seconds = time.perf_counter() - start
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    monitor.stop()
    files = files_under(run_dir)
    return {
        "method": method,
        "seconds": seconds,
        "cpu_user_seconds": cpu1.ru_utime - cpu0.ru_utime,
        "cpu_sys_seconds": cpu1.ru_stime - cpu0.ru_stime,
        "rss_baseline_nbytes": monitor.baseline_nbytes,
        "rss_added_nbytes": monitor.added_nbytes,
        "rss_sampled_peak_nbytes": monitor.sampled_peak_nbytes,
        "rss_hwm_peak_nbytes": monitor.hwm_peak_nbytes,
        "page_cache_nbytes": sum(resident_nbytes(p) for p in files),
        "files": {os.path.relpath(p, run_dir): os.path.getsize(p) for p in files},
        **extra,
    }


# ---------------------------------------------------------------- driver (parent)


class UsageError(Exception):
    """Bad command line or scratch folder: exit status 2."""



def prepare_out(out: str) -> str:
    """Create the scratch folder (or reuse one this benchmark made); refuse anything else."""
    out = os.path.abspath(out)
    if os.path.exists(out):
        if os.listdir(out) and not os.path.exists(os.path.join(out, SCRATCH_MARK)):
            raise UsageError(
                f"--out {out} exists and is not empty (and is not a bench_save scratch "
                "folder): choose an empty or new folder"
            )
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, SCRATCH_MARK), "w") as f:
        f.write("scratch folder of benchmarks/bench_save.py; removed at the end\n")
    return out


def clean_run_dir(run_dir: str, settle_s: float) -> None:
    for path in files_under(run_dir):
        discard_file(path)
    os.rmdir(run_dir)
    parent = os.path.dirname(run_dir)
    fsync_dir(parent)  # commit the unlinks (and the discards they trigger) now
    time.sleep(settle_s)


def run_case(
    label: str, manager, raw_view, nbytes: int, out: str, repeats: int, settle_s: float,
    quiet_wait_s: float, log,
) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for rep in range(repeats):
        # Rotate the order each repeat: no method always runs first or last.
        order = METHODS[rep % len(METHODS):] + METHODS[: rep % len(METHODS)]
        for method in order:
            run_dir = os.path.join(out, f"{label}-{method}-{rep}")
            os.makedirs(run_dir)
            try:
                waited, busy = wait_for_quiet(quiet_wait_s)
                load = loadavg1()
                written0 = device_written_nbytes(out)
                result = run_forked(measured_run, method, run_dir, manager, raw_view, nbytes)
                written1 = device_written_nbytes(out)
                result["repeat"] = rep
                result["loadavg1_before"] = load
                result["quiet_waited_seconds"] = waited
                result["busy_cores_before"] = busy
                result["device_written_nbytes"] = (
                    None if written0 is None or written1 is None else written1 - written0
                )
                if method != "raw":
                    result["xxh3"] = {
                        name: xxh3_file(os.path.join(run_dir, name)) for name in result["files"]
                    }
            finally:
                clean_run_dir(run_dir, settle_s)
            runs.append(result)
            log(
                f"  [{label}] {method:<15} run {rep + 1}/{repeats}: {result['seconds']:7.3f} s  "
                f"{nbytes / result['seconds'] / 1e9:6.3f} GB/s  "
                f"RSS +{result['rss_added_nbytes'] / MiB:7.1f} MiB  "
                f"cache {result['page_cache_nbytes'] / MiB:7.1f} MiB  "
                f"cpu {result['cpu_user_seconds']:.2f}u+{result['cpu_sys_seconds']:.2f}s  "
                f"others {busy:.2f} CPUs  disk +{(result['device_written_nbytes'] or 0) / MiB:.0f} MiB"
            )
    return runs


def summarize_case(label: str, desc: str, nbytes: int, expected_files, runs) -> dict[str, Any]:
    by_method = {m: [r for r in runs if r["method"] == m] for m in METHODS}
    reference = [r["xxh3"] for r in by_method["upstream"]]
    ref = reference[0]
    rows: dict[str, dict[str, Any]] = {}
    for method in METHODS:
        rs = by_method[method]
        secs = [r["seconds"] for r in rs]
        row: dict[str, Any] = {
            "seconds": median(secs),
            "seconds_min": min(secs),
            "seconds_max": max(secs),
            "rss_added_nbytes": median(r["rss_added_nbytes"] for r in rs),
            "rss_added_max_nbytes": max(r["rss_added_nbytes"] for r in rs),
            "page_cache_nbytes": median(r["page_cache_nbytes"] for r in rs),
            "page_cache_max_nbytes": max(r["page_cache_nbytes"] for r in rs),
        }
        row["gbps"] = nbytes / row["seconds"] / 1e9
        if method == "raw":
            row["identical"] = None
        elif method == "upstream":
            # The reference itself: every repeat must agree with the first.
            row["identical"] = all(h == ref for h in reference)
        else:
            row["identical"] = all(r["xxh3"] == ref for r in rs)
        rows[method] = row
    for row in rows.values():
        row["x_raw"] = rows["raw"]["seconds"] / row["seconds"]
        row["x_upstream"] = rows["upstream"]["seconds"] / row["seconds"]
        row["x_upstream_fsync"] = rows["upstream+fsync"]["seconds"] / row["seconds"]
    durable = [r for r in runs if r["method"] != "upstream" and r["device_written_nbytes"] is not None]
    return {
        "case": label,
        "description": desc,
        "ptdstream_plan_seconds": median(r["plan_seconds"] for r in by_method["ptdstream"]),
        "loadavg1_max": max(r["loadavg1_before"] for r in runs),
        "busy_cores_before_max": max(r["busy_cores_before"] for r in runs),
        # Device writes beyond the run's own bytes (journal, and other processes' I/O).
        "extra_device_written_max_nbytes": (
            max(r["device_written_nbytes"] - nbytes for r in durable) if durable else None
        ),
        "nbytes": nbytes,
        "files": expected_files,
        "reference_xxh3": ref,
        "rows": rows,
        "runs": runs,
    }


def targets(case: dict[str, Any]) -> list[dict[str, Any]]:
    row = case["rows"]["ptdstream"]
    label = case["case"]
    return [
        {
            "case": label,
            "target": f"ptdstream >= {MIN_RATIO_VS_RAW:.2f}x raw (write+fsync) throughput",
            "value": f"{row['x_raw']:.3f}x",
            "passed": row["x_raw"] >= MIN_RATIO_VS_RAW,
        },
        {
            "case": label,
            "target": "ptdstream no slower than upstream+fsync (durable vs durable)",
            "value": f"{row['x_upstream_fsync']:.3f}x",
            "passed": row["x_upstream_fsync"] >= 1.0,
        },
        {
            "case": label,
            "target": "ptdstream no slower than upstream as-is (no fsync; page-cache speed)",
            "value": f"{row['x_upstream']:.3f}x",
            "passed": row["x_upstream"] >= 1.0,
        },
        {
            "case": label,
            "target": f"peak RSS added <= {MAX_RSS_ADDED_NBYTES // MiB} MiB (worst run)",
            "value": f"{row['rss_added_max_nbytes'] / MiB:.1f} MiB",
            "passed": row["rss_added_max_nbytes"] <= MAX_RSS_ADDED_NBYTES,
        },
        {
            "case": label,
            "target": f"page cache after save <= {MAX_PAGE_CACHE_NBYTES // MiB} MiB (worst run)",
            "value": f"{row['page_cache_max_nbytes'] / MiB:.1f} MiB",
            "passed": row["page_cache_max_nbytes"] <= MAX_PAGE_CACHE_NBYTES,
        },
        {
            "case": label,
            "target": "output byte-identical to upstream (xxh3-128, every run)",
            "value": "yes" if row["identical"] else "NO",
            "passed": bool(row["identical"]),
        },
    ]


def render_table(cases: list[dict[str, Any]], repeats: int) -> str:
    header = (
        "case", "method", "seconds", "min-max s", "GB/s", "x raw", "x upstream",
        "x up+fsync", "RSS+ MiB", "cache MiB", "identical",
    )
    lines = []
    for case in cases:
        for method in METHODS:
            r = case["rows"][method]
            ident = {None: "n/a", True: "yes", False: "NO"}[r["identical"]]
            if method == "upstream" and r["identical"]:
                ident = "ref"
            lines.append((
                case["case"], method, f"{r['seconds']:.3f}",
                f"{r['seconds_min']:.2f}-{r['seconds_max']:.2f}", f"{r['gbps']:.3f}",
                f"{r['x_raw']:.3f}", f"{r['x_upstream']:.3f}", f"{r['x_upstream_fsync']:.3f}",
                f"{r['rss_added_nbytes'] / MiB:.1f}", f"{r['page_cache_nbytes'] / MiB:.1f}", ident,
            ))
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    left = {0, 1, 10}

    def fmt(cells):
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    rule = "-" * len(fmt(header))
    out = [fmt(header), rule]
    previous = None
    for line in lines:
        if previous is not None and line[0] != previous:
            out.append(rule)
        out.append(fmt(line))
        previous = line[0]
    out.append(rule)
    for case in cases:
        files = ", ".join(f"{k} {v:,} B" for k, v in case["files"].items())
        out.append(f"{case['case']}: {case['description']}; {case['nbytes']:,} bytes ({files})")
    out.append(
        f"Medians of {repeats} run(s). x raw / x upstream / x up+fsync = that method's seconds / "
        "this row's seconds (>1 = faster). RSS+ = peak RSS during the save minus RSS just before "
        "it. cache = page cache held by the output files right after the save."
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    parser.add_argument("--size-gib", type=float, default=1.5, help="model size in GiB (1.5)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per method and case (3)")
    parser.add_argument(
        "--out", default="./bench-out",
        help="scratch folder on the disk to measure (./bench-out); removed at the end",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--width", type=int, default=4096, help="Linear width (4096)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (0)")
    parser.add_argument(
        "--settle-s", type=float, default=1.0,
        help="pause after each run's cleanup, seconds (1.0)",
    )
    parser.add_argument(
        "--quiet-wait-s", type=float, default=5.0,
        help="before each run, wait up to this long for other processes to go idle (5)",
    )
    args = parser.parse_args(argv)
    if args.size_gib <= 0 or args.repeats < 1 or args.width < 1:
        parser.error("--size-gib, --repeats and --width must be positive")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    import xxhash  # noqa: F401 - imported before forking

    import ptdstream  # noqa: F401 - imported before forking

    try:
        out = prepare_out(args.out)
    except UsageError as e:
        log(f"bench_save.py: error: {e}")
        return 2
    t_all = time.perf_counter()
    try:
        model, example, n_layers, weight_nbytes = build_model(args.size_gib, args.width, args.seed)
        log(
            f"model: {n_layers} x Linear({args.width}, {args.width}) fp32, "
            f"{weight_nbytes / GiB:.3f} GiB of weights"
        )
        managers = {}
        export_seconds = {}
        for label, desc, external in CASES:
            t0 = time.perf_counter()
            managers[label] = export_manager(model, example, external)
            export_seconds[label] = time.perf_counter() - t0
            log(
                f"exported {label} ({desc}) in {export_seconds[label]:.1f} s; "
                f"parent RSS {os.sysconf('SC_PAGE_SIZE') * int(open('/proc/self/statm').read().split()[1]) / GiB:.2f}"
                " GiB"
            )
        sizes = {label: expected_nbytes(managers[label]) for label, _, _ in CASES}
        raw_nbytes = max(n for n, _ in sizes.values())
        raw_buf = filled_buffer(raw_nbytes, args.seed + 1)
        raw_view = memoryview(raw_buf)
        gc.collect()
        gc.freeze()  # children inherit everything as permanent: gc never walks (or dirties) it
        log(
            f"raw buffer {raw_nbytes / GiB:.3f} GiB ready; parent RSS "
            f"{os.sysconf('SC_PAGE_SIZE') * int(open('/proc/self/statm').read().split()[1]) / GiB:.2f} GiB; "
            f"measuring in {out}"
        )
        cases = []
        for label, desc, _ in CASES:
            nbytes, files = sizes[label]
            runs = run_case(
                label, managers[label], raw_view, nbytes, out, args.repeats, args.settle_s,
                args.quiet_wait_s, log,
            )
            cases.append(summarize_case(label, desc, nbytes, files, runs))
    except ChildError as e:
        log(f"a measured run failed:\n{e}")
        return 2
    finally:
        shutil.rmtree(out, ignore_errors=True)

    all_targets = [t for case in cases for t in targets(case)]
    print(render_table(cases, args.repeats))
    print()
    print("Targets (ptdstream):")
    for t in all_targets:
        print(f"  [{t['case']}] {'PASS' if t['passed'] else 'FAIL'}  {t['target']}: {t['value']}")
    for case in cases:
        rows = case["rows"]
        extra = case["extra_device_written_max_nbytes"]
        print(
            f"[{case['case']}] ptdstream plan phase {case['ptdstream_plan_seconds']:.3f} s of "
            f"{rows['ptdstream']['seconds']:.3f} s; best runs: ptdstream "
            f"{rows['ptdstream']['seconds_min']:.3f} s, upstream+fsync "
            f"{rows['upstream+fsync']['seconds_min']:.3f} s, raw {rows['raw']['seconds_min']:.3f} s; "
            f"others used up to {case['busy_cores_before_max']:.2f} CPUs just before a run "
            f"(1-min load up to {case['loadavg1_max']:.2f}); device writes beyond the run's own bytes "
            f"up to {'?' if extra is None else f'{extra / MiB:.0f}'} MiB"
        )
    if any(c["busy_cores_before_max"] >= 0.3 for c in cases):
        print(
            "WARNING: other processes were busy right before some runs (>= 0.3 of "
            f"{os.cpu_count()} CPUs even after waiting --quiet-wait-s): timings are noisy; "
            "rerun with more --repeats on a quiet machine."
        )
    total_s = time.perf_counter() - t_all
    print(f"(whole benchmark: {total_s:.0f} s; export A {export_seconds['A']:.0f} s, B {export_seconds['B']:.0f} s)")

    if args.json:
        result = {
            "args": vars(args),
            "environment": {
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "executorch": _version("executorch"),
                "ptdstream": getattr(sys.modules["ptdstream"], "__version__", None),
            },
            "model": {"n_layers": n_layers, "width": args.width, "weight_nbytes": weight_nbytes},
            "export_seconds": export_seconds,
            "cases": cases,
            "targets": all_targets,
            "total_seconds": total_s,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
        print(f"results written to {args.json}")
    return 0 if all(t["passed"] for t in all_targets) else 1


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001 - any failure to read the version prints as none
        return None


if __name__ == "__main__":
    sys.exit(main())
