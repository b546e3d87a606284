#!/usr/bin/env python
"""Benchmark ``ptdstream pack`` / ``unpack`` against the ``zstd`` command at the same level.

Three artifacts, exported from one decoder-only LM (:func:`ptdstream.demo.model.build_tiny_lm`,
scaled up; fixed seed) with torch.export -> ``to_edge_transform_and_lower`` ->
``to_executorch(ExecutorchBackendConfig(external_constants=True))`` -> ``ptdstream.save``:

  fp32-ptd   the fp32 model's weights (.ptd)
  bf16-ptd   the same model in bfloat16 (.ptd)
  xnnpack-pte  the fp32 model lowered with ``XnnpackPartitioner``: delegate blobs and
             XNNPACK's weights in the .pte

For each artifact, each repeat, and each tool (order alternates between repeats):

  ptdstream  ``pack(IN, OUT, level, threads)`` then ``unpack(OUT, BACK)`` in a fresh
             Python process; the time is measured around the call (it includes the
             sink's fsync: the result is durable), RSS+ is the peak RSS during the call
             minus the RSS just before it (``VmHWM`` reset through ``clear_refs``)
  zstd       ``zstd -<level> -T<threads> -q -f IN -o OUT`` then ``zstd -d -q -f OUT -o BACK``;
             the time is the process's wall time (no fsync: the output may still be
             in the page cache)
  zstd+fsync the same runs, plus an fsync of the output right after: durable like ptdstream

Before every run the input file is fsynced and its pages dropped (cold read for both
tools); outputs are removed and their pages dropped between runs. Peak RSS: for zstd
the whole process's (``VmHWM`` sampled every 2 ms from ``/proc``; ``wait4``'s
``ru_maxrss`` would count the forking parent); for ptdstream the peak added during the
call and the whole process's peak during it (Python interpreter included). Every unpacked file is compared with the
original (xxh3-128), and ``zstd -d`` of ptdstream's packed file is checked too.

Usage:
    python benchmarks/bench_pack.py                        # 215/108/215 MiB, 5 repeats
    python benchmarks/bench_pack.py --layers 2 --repeats 1 # quick
    python benchmarks/bench_pack.py --threads 2 --level 9 --json pack.json

Exit status: 0 every round trip byte-identical, 1 a mismatch, 2 usage or setup error.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import MiB, RssMonitor, discard_file, loadavg1, median, xxh3_file

TOOLS = ("ptdstream", "zstd", "zstd+fsync")
INTEROP = "zstd -d of ptdstream's"
SCRATCH_MARK = ".bench_pack-scratch"


# ---------------------------------------------------------------- child process


def child(op: str, src: str, dst: str, level: int, threads: int) -> None:
    """``--child``: run one pack or unpack; print seconds, RSS added during the call and
    the process's peak RSS during it (``VmHWM`` after the reset), in bytes."""
    from ptdstream.pack import pack, unpack

    monitor = RssMonitor()
    monitor.start()
    start = time.perf_counter()
    if op == "pack":
        pack(src, dst, level=level, threads=threads)
    else:
        unpack(src, dst)
    seconds = time.perf_counter() - start
    monitor.stop()
    peak = max(monitor.hwm_peak_nbytes or 0, monitor.sampled_peak_nbytes)
    print(json.dumps({"seconds": seconds, "rss_added_nbytes": monitor.added_nbytes, "rss_peak_nbytes": peak}))


def _sample_hwm(pid: int, peak: list[int], done: threading.Event) -> None:
    path = f"/proc/{pid}/status"
    while not done.is_set():
        try:
            with open(path, "rb") as f:
                for line in f:
                    if line.startswith(b"VmHWM:"):
                        peak[0] = max(peak[0], int(line.split()[1]) * 1024)
                        break
        except (OSError, ValueError):
            pass
        done.wait(0.002)


def run_process(cmd: list[str]) -> dict[str, Any]:
    """Run ``cmd``; wall seconds, peak RSS in bytes and stdout.

    The peak is the child's ``VmHWM`` sampled every 2 ms from ``/proc/<pid>/status``:
    ``wait4``'s ``ru_maxrss`` would include the RSS of this (forking) process.
    """
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out)
        peak, done = [0], threading.Event()
        sampler = threading.Thread(target=_sample_hwm, args=(proc.pid, peak, done), daemon=True)
        sampler.start()
        proc.wait()
        wall = time.perf_counter() - start
        done.set()
        sampler.join()
        out.seek(0)
        text = out.read().decode()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}: {text[-2000:]}")
    return {"wall_seconds": wall, "proc_rss_nbytes": peak[0], "stdout": text}


def cold(path: str) -> None:
    """fsync ``path`` and drop its pages: the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsync_seconds(path: str) -> float:
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


# ---------------------------------------------------------------- artifacts


def export_artifacts(out: str, dim: int, layers: int, vocab: int, log) -> dict[str, str]:
    """Export the three artifacts into ``out``; returns ``{name: path}``. Runs in a
    child process (``--export``), so this process stays small: the tools it starts
    are forked from it."""
    import torch
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    import ptdstream
    from ptdstream.demo.model import TinyLMConfig, build_tiny_lm

    config = TinyLMConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=max(1, dim // 64),
                          hidden_dim=dim * 8 // 3 // 64 * 64 or 64, max_seq_len=16)
    tokens = (torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0)),)
    found = {}
    for name, dtype, xnnpack, pick in (
        ("fp32-ptd", torch.float32, False, ".ptd"),
        ("bf16-ptd", torch.bfloat16, False, ".ptd"),
        ("xnnpack-pte", torch.float32, True, ".pte"),
    ):
        start = time.perf_counter()
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        partitioner = None
        if xnnpack:
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

            partitioner = [XnnpackPartitioner()]
        model = build_tiny_lm(config).to(dtype)
        edge = to_edge_transform_and_lower(torch.export.export(model, tokens), partitioner=partitioner)
        manager = edge.to_executorch(ExecutorchBackendConfig(external_constants=True))
        ptdstream.save(manager, os.path.join(folder, "model.pte"))
        del manager, edge, model
        gc.collect()
        files = sorted(f for f in os.listdir(folder) if f.endswith(pick))
        found[name] = os.path.join(folder, files[0])
        sizes = ", ".join(f"{f} {os.path.getsize(os.path.join(folder, f)) / MiB:.1f} MiB"
                          for f in sorted(os.listdir(folder)))
        log(f"exported {name}: {sizes} in {time.perf_counter() - start:.0f} s")
    return found


# ---------------------------------------------------------------- runs


def run_tool(tool: str, src: str, folder: str, level: int, threads: int) -> dict[str, Any]:
    """One pack + unpack with ``tool`` ("ptdstream" or "zstd"); outputs left in ``folder``."""
    packed, back = os.path.join(folder, f"{tool}.zst"), os.path.join(folder, f"{tool}.back")
    cold(src)
    if tool == "ptdstream":
        me = [sys.executable, os.path.abspath(__file__), "--child"]
        p = run_process(me + ["pack", src, packed, str(level), str(threads)])
        cold(packed)
        u = run_process(me + ["unpack", packed, back, str(level), str(threads)])
        pj, uj = json.loads(p["stdout"]), json.loads(u["stdout"])
        return {"pack_seconds": pj["seconds"], "unpack_seconds": uj["seconds"],
                "pack_rss_added": pj["rss_added_nbytes"], "unpack_rss_added": uj["rss_added_nbytes"],
                "pack_rss_proc": pj["rss_peak_nbytes"], "unpack_rss_proc": uj["rss_peak_nbytes"],
                "packed_nbytes": os.path.getsize(packed), "packed": packed, "back": back}
    zstd = shutil.which("zstd")
    p = run_process([zstd, f"-{level}", f"-T{threads}", "-q", "-f", src, "-o", packed])
    p_sync = fsync_seconds(packed)
    cold(packed)
    u = run_process([zstd, "-d", "-q", "-f", packed, "-o", back])
    u_sync = fsync_seconds(back)
    return {"pack_seconds": p["wall_seconds"], "unpack_seconds": u["wall_seconds"],
            "pack_fsync_seconds": p_sync, "unpack_fsync_seconds": u_sync,
            "pack_rss_added": p["proc_rss_nbytes"], "unpack_rss_added": u["proc_rss_nbytes"],
            "pack_rss_proc": p["proc_rss_nbytes"], "unpack_rss_proc": u["proc_rss_nbytes"],
            "packed_nbytes": os.path.getsize(packed), "packed": packed, "back": back}


def bench_artifact(name: str, src: str, out: str, args, log) -> dict[str, Any]:
    nbytes = os.path.getsize(src)
    digest = xxh3_file(src)
    runs: dict[str, list[dict[str, Any]]] = {"ptdstream": [], "zstd": []}
    checks: dict[str, bool | None] = {"ptdstream": None, "zstd": None, INTEROP: None}
    for rep in range(args.repeats):
        for tool in (("ptdstream", "zstd") if rep % 2 == 0 else ("zstd", "ptdstream")):
            folder = os.path.join(out, f"run-{name}-{tool}-{rep}")
            os.makedirs(folder)
            r = run_tool(tool, src, folder, args.level, args.threads)
            if checks[tool] is None or rep == 0:
                checks[tool] = xxh3_file(r["back"]) == digest
            if tool == "ptdstream" and rep == 0:
                check = os.path.join(folder, "zstd-d.back")
                subprocess.run([shutil.which("zstd"), "-d", "-q", "-f", r["packed"], "-o", check], check=True)
                checks[INTEROP] = xxh3_file(check) == digest
            for path in os.listdir(folder):
                discard_file(os.path.join(folder, path))
            os.rmdir(folder)
            runs[tool].append(r)
            log(f"  {name} {tool} repeat {rep}: pack {r['pack_seconds']:.2f} s, unpack {r['unpack_seconds']:.2f} s")
    rows = {}
    for tool in TOOLS:
        base = runs["ptdstream" if tool == "ptdstream" else "zstd"]

        def med(key: str, plus: str | None = None, pick=median, base=base) -> float:
            return pick([r[key] + (r[plus] if plus else 0.0) for r in base])

        sync = tool == "zstd+fsync"
        pack_s = med("pack_seconds", "pack_fsync_seconds" if sync else None)
        unpack_s = med("unpack_seconds", "unpack_fsync_seconds" if sync else None)
        best_pack_s = med("pack_seconds", "pack_fsync_seconds" if sync else None, min)
        best_unpack_s = med("unpack_seconds", "unpack_fsync_seconds" if sync else None, min)
        rows[tool] = {
            "packed_nbytes": base[0]["packed_nbytes"], "ratio": nbytes / base[0]["packed_nbytes"],
            "pack_seconds": pack_s, "unpack_seconds": unpack_s,
            "pack_mbps": nbytes / pack_s / 1e6, "unpack_mbps": nbytes / unpack_s / 1e6,
            "pack_mbps_best": nbytes / best_pack_s / 1e6, "unpack_mbps_best": nbytes / best_unpack_s / 1e6,
            "pack_rss_added": med("pack_rss_added"), "unpack_rss_added": med("unpack_rss_added"),
            "pack_rss_proc": med("pack_rss_proc"), "unpack_rss_proc": med("unpack_rss_proc"),
            "identical": checks["ptdstream" if tool == "ptdstream" else "zstd"],
        }
    return {"artifact": name, "path": src, "nbytes": nbytes, "rows": rows, "checks": checks,
            "runs": {k: [{kk: vv for kk, vv in r.items() if kk not in ("packed", "back")} for r in v]
                     for k, v in runs.items()}}


def render_table(results: list[dict[str, Any]], args) -> str:
    header = ("artifact", "tool", "MiB", "packed MiB", "ratio", "pack MB/s", "unpack MB/s",
              "pack RSS MiB", "unpack RSS MiB", "identical")
    lines = []
    for res in results:
        for tool in TOOLS:
            r = res["rows"][tool]
            rss = (lambda k, r=r: f"{r[k + '_rss_added'] / MiB:.1f} / {r[k + '_rss_proc'] / MiB:.1f}") \
                if tool == "ptdstream" else (lambda k, r=r: f"{r[k + '_rss_proc'] / MiB:.1f}")
            lines.append((res["artifact"], tool, f"{res['nbytes'] / MiB:.1f}", f"{r['packed_nbytes'] / MiB:.1f}",
                          f"{r['ratio']:.4f}", f"{r['pack_mbps']:.0f} ({r['pack_mbps_best']:.0f})",
                          f"{r['unpack_mbps']:.0f} ({r['unpack_mbps_best']:.0f})",
                          rss("pack"), rss("unpack"), {None: "n/a", True: "yes", False: "NO"}[r["identical"]]))
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]

    def fmt(cells):
        return "  ".join(c.ljust(w) if i in (0, 1, 9) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    rule = "-" * len(fmt(header))
    out = [fmt(header), rule]
    for i, line in enumerate(lines):
        if i and i % len(TOOLS) == 0:
            out.append(rule)
        out.append(fmt(line))
    out.append(rule)
    out.append(f"zstd level {args.level}, {args.threads} compression thread(s) for both tools; ptdstream frames "
               f"of 8 MiB + seek table; MB/s = 10^6 bytes of the original a second, median (best) of "
               f"{args.repeats} run(s).")
    out.append("RSS: peak resident memory; ptdstream = added during the call / whole process during it (Python "
               "included); zstd = whole process (VmHWM sampled every 2 ms). "
               "ptdstream times include fsync of the output; zstd rows without / with it.")
    for res in results:
        c = res["checks"]
        out.append(f"{res['artifact']}: {res['path']}; zstd -d of ptdstream's output identical: "
                   f"{'yes' if c[INTEROP] else 'NO'}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("Usage:")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out/pack", help="scratch folder (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per tool and artifact (5)")
    parser.add_argument("--level", type=int, default=3, help="zstd level for both tools (3)")
    parser.add_argument("--threads", type=int, default=1, help="compression threads for both tools (1)")
    parser.add_argument("--dim", type=int, default=768, help="model width (768)")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks (8)")
    parser.add_argument("--vocab", type=int, default=16000, help="vocabulary size (16000)")
    parser.add_argument("--keep", action="store_true", help="keep the exported artifacts")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--child", nargs=5, metavar=("OP", "SRC", "DST", "LEVEL", "THREADS"), help=argparse.SUPPRESS)
    parser.add_argument("--export", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.export:
        paths = export_artifacts(args.out, args.dim, args.layers, args.vocab,
                                 lambda m: print(m, file=sys.stderr, flush=True))
        print(json.dumps(paths))
        return 0
    if args.child:
        op, src, dst, level, threads = args.child
        child(op, src, dst, int(level), int(threads))
        return 0

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if shutil.which("zstd") is None:
        log("the zstd command is not installed (apt-get install -y zstd)")
        return 2
    out = os.path.abspath(args.out)
    if os.path.exists(out) and os.listdir(out) and not os.path.exists(os.path.join(out, SCRATCH_MARK)):
        log(f"--out {out} exists, is not empty and is not a bench_pack scratch folder")
        return 2
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, SCRATCH_MARK), "w").close()
    start, load_before = time.perf_counter(), loadavg1()
    exported = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--export", "--out", out, "--dim", str(args.dim),
         "--layers", str(args.layers), "--vocab", str(args.vocab)], stdout=subprocess.PIPE, check=True)
    artifacts = json.loads(exported.stdout.decode().strip().splitlines()[-1])
    results = [bench_artifact(name, path, out, args, log) for name, path in artifacts.items()]
    print(render_table(results, args))
    version = subprocess.run(["zstd", "--version"], capture_output=True, text=True).stdout.split(",")[0]
    print(f"({version.strip('* ')}; {os.cpu_count()} CPUs, 1-min load average {load_before:.1f} before, "
          f"{loadavg1():.1f} after; whole benchmark {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    if not args.keep:
        shutil.rmtree(out)
    ok = all(r["identical"] for res in results for r in res["rows"].values()) and all(
        res["checks"][INTEROP] for res in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
