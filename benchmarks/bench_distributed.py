"""Many ranks, one artifact: ``ptdstream.distributed.write_data_files`` on 1, 2 and 4
CPU ranks (gloo) vs one raw write of the same bytes; wall time and peak RSS per rank.

    python benchmarks/bench_distributed.py --gib 1 --out /tmp/bench-dist      # here
    python benchmarks/bench_distributed.py --gib 6 --out /big/disk/bench-dist  # the issue's size

The state dict: ``round(gib * 16)`` fp32 ``[4096, 4096]`` weights (64 MiB each), each a
DTensor ``Shard(0)`` over a 1-D mesh of the ranks; each rank builds only its rows
(so a rank holds ``1 / ranks`` of the weights). Each rank process: gloo group,
import torch and executorch, build its shards, barrier, reset ``VmHWM``, ``write_data_files`` into
``out/model.ptd``, barrier. Time: rank 0's wall time between the two barriers.
Peak RSS: per rank, over its RSS before the call (its shards included in the
baseline). ``raw``: one process ``write``\\ s the same number of bytes from one
64 MiB buffer, then ``fsync``, twice: after 20 s idle and at once after that
(``raw`` is the faster; see ``raw_write``).

``--backend nccl`` is the GPU half (one GPU per rank, NCCL; weights made on each
rank's GPU): on two H200s of one host,

    python benchmarks/bench_distributed.py --backend nccl --gib 16 --ranks 1,2 --out /tmp/bench-dist

writes 16 GiB from one GPU and then from two ranks holding 8 GiB each; the table
adds each rank's GPU peak (``max_memory_allocated``, reset after the shards are
made, so it is what the save adds; "GPU held" is the shards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import discard_file, files_under, raw_write_fsync, reset_peak_rss, status_kib

GiB = 1 << 30
MiB = 1 << 20
WIDTH = 4096


def rank_main(rank: int, world: int, layers: int, out: str, result_dir: str, backend: str = "gloo") -> None:
    import executorch.exir.tensor  # imports outside the timed part
    import executorch.extension.flat_tensor.serialize.serialize  # noqa: F401 - imported outside the timed part
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from ptdstream.distributed import write_data_files

    gpu = backend == "nccl"
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{out}/.pg", rank=rank, world_size=world,
                            timeout=timedelta(minutes=30))
    mesh = init_device_mesh(device.type, (world,))
    rows = [len(c) for c in torch.arange(WIDTH).chunk(world)]
    rows += [0] * (world - len(rows))
    tensors = {}
    for layer in range(layers):
        g = torch.Generator(device=device).manual_seed(layer * 1000 + rank)
        local = torch.randn(rows[rank], WIDTH, generator=g, device=device)
        tensors[f"layers.{layer}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                              shape=torch.Size([WIDTH, WIDTH]),
                                                              stride=(WIDTH, 1))
    local_nbytes = sum(t.to_local().numel() * 4 for t in tensors.values())
    if gpu:
        torch.cuda.synchronize()
        gpu_held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    base = status_kib("VmRSS") * 1024
    reset_peak_rss()
    t = time.perf_counter()
    report = write_data_files(tensors, out, external_tag="model")
    dist.barrier()
    seconds = time.perf_counter() - t
    peak = status_kib("VmHWM") * 1024
    result = {"seconds": seconds, "peak_added": peak - base, "local_nbytes": local_nbytes,
              "written": report.rank_nbytes, "files": report.files}
    if gpu:
        result["gpu_held"] = gpu_held
        result["gpu_peak_added"] = torch.cuda.max_memory_allocated() - gpu_held
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def run_ranks(world: int, layers: int, out: str, backend: str = "gloo") -> dict:
    import multiprocessing as mp

    results = os.path.join(out, ".results")
    os.makedirs(results, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, world, layers, out, results, backend)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"{world} ranks: exit codes {[p.exitcode for p in procs]}")
    ranks = []
    for r in range(world):
        with open(os.path.join(results, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    shutil.rmtree(results)
    for path in files_under(out):
        if path.endswith(".ptd"):
            size = os.path.getsize(path)
            discard_file(path)
    try:
        os.remove(os.path.join(out, ".pg"))
    except FileNotFoundError:
        pass
    return {"seconds": ranks[0]["seconds"], "ranks": ranks, "file_nbytes": size}


def raw_write(nbytes: int, out: str, settle_s: float = 20.0) -> dict:
    """Two raw writes: after ``settle_s`` idle seconds ("cold") and at once after it
    ("warm"); ``seconds`` is the faster. On a VM whose host takes back idle guest
    memory (this project's 2-core machine does: a 6 GiB write after 15 s idle runs
    at 0.4 GB/s, at once after another at 2-3 GB/s), page cache that was freed a
    while ago is slow to use again; a writer that keeps a few windows cached
    barely sees it, one that fills the cache does."""
    buf = memoryview(bytearray(os.urandom(1 << 20) * 64))
    path = os.path.join(out, "raw.bin")
    time.sleep(settle_s)
    cold = raw_write_fsync(path, nbytes, buf)
    discard_file(path)
    warm = raw_write_fsync(path, nbytes, buf)
    discard_file(path)
    return {"seconds": min(cold, warm), "cold_seconds": cold, "warm_seconds": warm}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=6.0, help="weight size in GiB (default 6, the issue's)")
    parser.add_argument("--ranks", default="1,2,4", help="world sizes to run (default 1,2,4)")
    parser.add_argument("--out", default="./bench-dist", help="scratch folder (created, removed at the end)")
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="gloo: CPU ranks (default); nccl: one GPU per rank")
    args = parser.parse_args()
    layers = max(1, round(args.gib * 16))
    os.makedirs(args.out, exist_ok=True)
    try:
        results = {}
        for world in [int(w) for w in args.ranks.split(",")]:
            print(f"[{time.strftime('%H:%M:%S')}] {world} rank(s)", file=sys.stderr, flush=True)
            results[world] = run_ranks(world, layers, os.path.abspath(args.out), args.backend)
        nbytes = results[next(iter(results))]["file_nbytes"]
        print(f"[{time.strftime('%H:%M:%S')}] raw", file=sys.stderr, flush=True)
        raw = raw_write(nbytes, args.out)
        gpu = args.backend == "nccl"
        head = (f"{'writer':<10} {'seconds':>8} {'GB/s':>6} {'x raw':>6} {'peak+ MiB/rank (max)':>21} "
                f"{'held MiB/rank':>13}" + (f" {'GPU held GiB/rank':>17} {'GPU peak+ MiB/rank':>18}" if gpu else ""))
        lines = [f"weights: {layers * WIDTH * WIDTH * 4 / GiB:.2f} GiB ({args.backend}), file {nbytes:,} bytes",
                 head, "-" * len(head)]
        for world, r in results.items():
            peak = max(x["peak_added"] for x in r["ranks"]) / MiB
            held = max(x["local_nbytes"] for x in r["ranks"]) / MiB
            lines.append(f"{f'{world} rank(s)':<10} {r['seconds']:>8.2f} {nbytes / r['seconds'] / 1e9:>6.2f} "
                         f"{r['seconds'] / raw['seconds']:>6.2f} {peak:>21.0f} {held:>13.0f}"
                         + (f" {max(x['gpu_held'] for x in r['ranks']) / GiB:>17.2f}"
                            f" {max(x['gpu_peak_added'] for x in r['ranks']) / MiB:>18.0f}" if gpu else ""))
        for name, key in (("raw", "seconds"), ("raw cold", "cold_seconds"), ("raw warm", "warm_seconds")):
            lines.append(f"{name:<10} {raw[key]:>8.2f} {nbytes / raw[key] / 1e9:>6.2f} "
                         f"{raw[key] / raw['seconds']:>6.2f} {'-':>21} {'-':>13}")
        print("\n".join(lines))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"results": results, "raw": raw}, f, indent=1)
        return 0
    finally:
        shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
