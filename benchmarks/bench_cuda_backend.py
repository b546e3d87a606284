"""executorch's CUDA backend, several methods sharing every weight: upstream's weight collector vs ptdstream.

Run on a GPU machine (one table, side by side, one run):

    python benchmarks/bench_cuda_backend.py --gib 2 16 --out /tmp/bench-cuda-backend

The scenario of issue 6: ``--layers`` x ``nn.Linear(dim, dim)`` in bf16, resident
on the GPU (``dim`` 8192 at 2 GiB; at other sizes the width grows so that the
weights total ``--gib``), exported once per batch size (``--batches``, default
1 4 16, methods ``batch1``...) and lowered with ``to_edge_transform_and_lower``
and one ``CudaPartitioner`` per method, then ``to_executorch``; every method
shares every weight. Each variant runs in its own fresh Python process, one
after the other:

* ``raw``: one ``os.write`` + ``fsync`` of the weight bytes from a reused 64 MiB
  buffer (run before and after the two exports; the mean is the yardstick);
* ``upstream``: lowering as executorch 1.5.1 does it (its collector copies each
  storage to the host in 8 MiB ``.cpu()`` chunks, SHA-256s and writes it, once
  per method), then ``write_to_file`` + ``write_tensor_data_to_file`` and an
  ``fsync`` of every file written;
* ``ptdstream``: the same lowering inside :func:`ptdstream.cuda_backend.stream_cuda_weights`,
  then ``ptdstream.save`` (fsync and rename included).

Weight handling (``weights s``; ``/raw`` divides it by the raw write) = the time spent in the collector's ``materialize`` (once per
method: upstream's copy + hash + write, or ptdstream's device copy + GPU
fingerprint; both include upstream's own ``gc.collect`` + ``malloc_trim``) plus
the save. RSS is sampled every 5 ms and from ``VmHWM``: "RSS+ weights" is the
largest rise during one ``materialize`` call or the save, over the RSS at its
start; "peak RSS" is the process's high-water mark during lowering and save
("peak+": over the RSS just before lowering; "x weights": peak RSS / weight bytes).
Byte identity (xxh3-128): the .ptd equals upstream's; the .pte (which holds the AOTI .so
compiled in its own process) equals upstream's serializer on the same manager.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import RssSampler, discard_file, files_under, reset_peak_rss, status_kib, xxh3_file  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


# ---------------------------------------------------------------- child side


def child_raw(args) -> dict:
    path = os.path.join(args.out, "raw.bin")
    buf = memoryview(bytearray(64 * MiB))
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = args.nbytes
    while left:
        left -= os.write(fd, buf[: min(len(buf), left)])
    os.fsync(fd)
    os.close(fd)
    seconds = time.perf_counter() - t
    discard_file(path)
    return {"seconds": seconds}


def child_export(args) -> dict:
    import torch
    from executorch.backends.cuda import cuda_weight_collector as collector_module
    from executorch.backends.cuda.cuda_backend import CudaBackend
    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    import ptdstream
    from ptdstream.executorch.cuda_backend import stream_cuda_weights

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[
        torch.nn.Linear(args.dim, args.dim, dtype=torch.bfloat16, device="cuda")
        for _ in range(args.layers)
    ]).eval()
    weights_nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    methods = {f"batch{b}": b for b in args.batches}
    t = time.perf_counter()
    programs = {
        name: torch.export.export(
            model, (torch.randn(b, args.dim, dtype=torch.bfloat16, device="cuda"),), strict=False
        )
        for name, b in methods.items()
    }
    export_s = time.perf_counter() - t
    partitioners = {
        name: [CudaPartitioner([CudaBackend.generate_method_name_compile_spec(name)])]
        for name in programs
    }
    res = {"weights_nbytes": weights_nbytes, "export_s": export_s, "materialize": [],
           "written_while_lowering": 0, "gpu": torch.cuda.get_device_name()}

    rss = RssSampler()
    real_materialize = collector_module.CudaWeightCollector.materialize

    current = {}

    def materialize(self, weights, *a, **kw):
        record = {"storages": len(weights), "write_s": 0.0}
        current["record"] = record
        with rss.window(record):
            out = real_materialize(self, weights, *a, **kw)
            torch.cuda.synchronize()
        res["materialize"].append(record)
        return out

    def count_writes(write):
        def counted(tensor, path):
            t = time.perf_counter()
            out = write(tensor, path)
            torch.cuda.synchronize()
            current["record"]["write_s"] += time.perf_counter() - t
            res["written_while_lowering"] += os.path.getsize(path)
            return out
        return counted

    torch.cuda.synchronize()
    res["rss_before_lowering"] = status_kib("VmRSS") * 1024
    reset_peak_rss()
    collector_module.CudaWeightCollector.materialize = materialize
    routed = stream_cuda_weights() if args.variant == "ptdstream" else None
    stats = routed.__enter__() if routed is not None else None
    real_write = collector_module._write_tensor_storage
    collector_module._write_tensor_storage = count_writes(real_write)
    t = time.perf_counter()
    try:
        edge = to_edge_transform_and_lower(
            programs, partitioner=partitioners,
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
        )
        manager = edge.to_executorch()
    finally:
        collector_module._write_tensor_storage = real_write
        if routed is not None:
            routed.__exit__(None, None, None)
        collector_module.CudaWeightCollector.materialize = real_materialize
    res["lower_s"] = time.perf_counter() - t
    if stats is not None:
        res["routed"], res["routed_nbytes"], res["copied_nbytes"] = (
            stats.routed, stats.routed_nbytes, stats.copied_nbytes)
    del edge, programs

    out = os.path.join(args.out, args.variant)
    os.makedirs(out, exist_ok=True)
    save = {}
    save_start = time.perf_counter()
    with rss.window(save):
        if args.variant == "ptdstream":
            report = ptdstream.save(manager, os.path.join(out, "model.pte"))
            res["save_plan_s"] = report.plan_seconds
        else:
            with open(os.path.join(out, "model.pte"), "wb") as f:
                manager.write_to_file(f)
            manager.write_tensor_data_to_file(out)
            res["save_as_is_s"] = time.perf_counter() - save_start
            for path in files_under(out):
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
    res["save"] = save
    res["peak_rss"] = max(rss.peak["VmRSS"], status_kib("VmHWM") * 1024)
    res["gpu_peak_nbytes"] = torch.cuda.max_memory_allocated()
    rss.stop()
    res["files"] = {os.path.basename(p): (os.path.getsize(p), xxh3_file(p)) for p in files_under(out)}
    if args.variant == "ptdstream":
        # The .pte holds each process's own AOTI .so, so it is compared with
        # upstream's serializer on this same manager (the .ptd across processes).
        reference = os.path.join(args.out, "reference.pte")
        with open(reference, "wb") as f:
            manager.write_to_file(f)
        res["reference_pte"] = (os.path.getsize(reference), xxh3_file(reference))
        discard_file(reference)
    for p in files_under(out):
        discard_file(p)
    return res


# ---------------------------------------------------------------- parent side


def run_child(args, variant: str, **extra) -> dict:
    result = os.path.join(args.out, f"{variant}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--out", args.out,
           "--result", result, "--layers", str(extra["layers"]), "--dim", str(extra["dim"]),
           "--nbytes", str(extra["nbytes"]), "--batches", *map(str, args.batches)]
    print(f"[{time.strftime('%H:%M:%S')}] {variant} ({extra['nbytes'] / GiB:.2f} GiB)", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    os.sync()
    with open(result) as f:
        return json.load(f)


def width_for(gib: float, layers: int) -> int:
    """Square bf16 width (multiple of 64) whose ``layers`` weights total ``gib`` GiB."""
    return max(64, round((gib * GiB / layers / 2) ** 0.5 / 64) * 64)


def measure(args, gib: float) -> dict:
    dim = width_for(gib, args.layers)
    nbytes = args.layers * (dim * dim + dim) * 2
    shape = {"layers": args.layers, "dim": dim, "nbytes": nbytes}
    raw = [run_child(args, "raw", **shape)["seconds"]]
    up = run_child(args, "upstream", **shape)
    ours = run_child(args, "ptdstream", **shape)
    raw.append(run_child(args, "raw", **shape)["seconds"])
    return {"gib": gib, "dim": dim, "nbytes": nbytes, "raw_s": raw, "upstream": up, "ptdstream": ours}


def weight_handling_s(r: dict) -> float:
    return sum(m["seconds"] for m in r["materialize"]) + r["save"]["seconds"]


def table(results: List[dict], layers: int) -> str:
    lines = []
    for res in results:
        raw_s = sum(res["raw_s"]) / len(res["raw_s"])
        w = res["nbytes"]
        up, ours = res["upstream"], res["ptdstream"]
        lines.append(f"{res['gib']:g} GiB of weights: {layers} x Linear({res['dim']}, {res['dim']}) bf16 on "
                     f"{ours['gpu']}, {len(ours['materialize'])} methods; raw write + fsync of "
                     f"{w / GiB:.2f} GiB: {' / '.join(f'{s:.2f}' for s in res['raw_s'])} s "
                     f"(mean {raw_s:.2f} s, {w / raw_s / 1e9:.2f} GB/s)")
        head = (f"  {'variant':<10} {'lower s':>8} {'per method s':>22} {'of which write s':>22} {'save s':>7} {'weights s':>9} "
                f"{'/raw':>6} {'written GiB':>11} {'RSS+ weights MiB':>16} {'peak RSS GiB':>12} {'peak+ GiB':>9} "
                f"{'x weights':>9} {'GPU peak GiB':>12}")
        lines += [head, "  " + "-" * (len(head) - 2)]
        for name, r in (("upstream", up), ("ptdstream", ours)):
            handling = weight_handling_s(r)
            per = " / ".join(f"{m['seconds']:.3f}" for m in r["materialize"])
            writes = " / ".join(f"{m['write_s']:.3f}" for m in r["materialize"])
            rss_added = max([m["rss_added"] for m in r["materialize"]] + [r["save"]["rss_added"]])
            lines.append(
                f"  {name:<10} {r['lower_s']:>8.1f} {per:>22} {writes:>22} {r['save']['seconds']:>7.2f} {handling:>9.2f} "
                f"{handling / raw_s:>6.2f} {r['written_while_lowering'] / GiB:>11.2f} {rss_added / MiB:>16.1f} "
                f"{r['peak_rss'] / GiB:>12.2f} {(r['peak_rss'] - r['rss_before_lowering']) / GiB:>9.2f} {r['peak_rss'] / w:>9.2f} {r['gpu_peak_nbytes'] / GiB:>12.2f}")
        first = ours["materialize"][0]["seconds"] + ours["save"]["seconds"]
        later = [m["seconds"] for m in ours["materialize"][1:]]
        ptds = sorted(n for n in ours["files"] if n.endswith(".ptd"))
        same_ptd = ptds == sorted(n for n in up["files"] if n.endswith(".ptd")) and all(
            ours["files"][n] == up["files"][n] for n in ptds)
        same_pte = tuple(ours["files"]["model.pte"]) == tuple(ours["reference_pte"])
        same = same_ptd and same_pte
        lines.append(f"  upstream save as-is (no fsync): {up['save_as_is_s']:.2f} s; "
                     f"ptdstream save: {ours['save_plan_s']:.2f} s of planning; "
                     f"RSS before lowering: upstream {up['rss_before_lowering'] / GiB:.2f} GiB, "
                     f"ptdstream {ours['rss_before_lowering'] / GiB:.2f} GiB")
        lines.append("  ptdstream methods 2..: " + ", ".join(f"{100 * s / first:.3f}%" for s in later)
                     + f" of the first (its materialize + save, {first:.2f} s); device copies kept: "
                     f"{ours.get('copied_nbytes', 0) / GiB:.2f} GiB for {ours.get('routed_nbytes', 0) / GiB:.2f} GiB routed")
        lines.append("  files: " + ", ".join(f"{n} {s:,} B" for n, (s, _) in sorted(ours["files"].items()))
                     + f"; .ptd byte-identical to upstream's export: {'yes' if same_ptd else 'NO'}; "
                     f".pte byte-identical to upstream's serializer on the same manager: {'yes' if same_pte else 'NO'}")
        targets = [
            ("weight handling <= 1.1x one raw write", weight_handling_s(ours) <= 1.1 * raw_s),
            ("methods 2.. < 1% of the first", all(s < 0.01 * first for s in later)),
            ("host RSS added by weight handling <= 256 MiB",
             max([m["rss_added"] for m in ours["materialize"]] + [ours["save"]["rss_added"]]) <= 256 * MiB),
            ("byte-identical to upstream", same),
        ]
        lines += [f"  {'PASS' if ok else 'FAIL'} {what}" for what, ok in targets]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[2, 16], help="weight sizes to run (GiB)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16], help="one method per batch size")
    p.add_argument("--out", default="./bench-cuda-backend-out", help="scratch folder (removed at the end)")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    p.add_argument("--child", choices=["raw", "upstream", "ptdstream"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--dim", type=int, help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.variant = args.child
        res = child_raw(args) if args.child == "raw" else child_export(args)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return 0
    os.makedirs(args.out, exist_ok=True)
    results = []
    try:
        for gib in args.gib:
            results.append(measure(args, gib))
            print(table(results[-1:], args.layers), flush=True)
    finally:
        shutil.rmtree(args.out, ignore_errors=True)
    if len(results) > 1:
        print(table(results, args.layers))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    fails = table(results, args.layers).count("\n  FAIL ")
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
