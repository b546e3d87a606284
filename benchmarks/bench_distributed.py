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
64 MiB buffer, then ``fsync``. The NCCL (GPU) half of the issue's benchmark is
not here: it needs GPUs.
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
from _measure import discard_file, files_under, raw_write_fsync, reset_peak_rss, status_kib  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
WIDTH = 4096


def rank_main(rank: int, world: int, layers: int, out: str, result_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import executorch.exir.tensor  # noqa: F401 - imports outside the timed part
    import executorch.extension.flat_tensor.serialize.serialize  # noqa: F401

    from ptdstream.distributed import write_data_files

    dist.init_process_group("gloo", init_method=f"file://{out}/.pg", rank=rank, world_size=world,
                            timeout=timedelta(minutes=30))
    mesh = init_device_mesh("cpu", (world,))
    rows = [len(c) for c in torch.arange(WIDTH).chunk(world)]
    rows += [0] * (world - len(rows))
    tensors = {}
    for layer in range(layers):
        g = torch.Generator().manual_seed(layer * 1000 + rank)
        local = torch.randn(rows[rank], WIDTH, generator=g)
        tensors[f"layers.{layer}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                              shape=torch.Size([WIDTH, WIDTH]),
                                                              stride=(WIDTH, 1))
    local_nbytes = sum(t.to_local().numel() * 4 for t in tensors.values())
    dist.barrier()
    base = status_kib("VmRSS") * 1024
    reset_peak_rss()
    t = time.perf_counter()
    report = write_data_files(tensors, out, external_tag="model")
    dist.barrier()
    seconds = time.perf_counter() - t
    peak = status_kib("VmHWM") * 1024
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"seconds": seconds, "peak_added": peak - base, "local_nbytes": local_nbytes,
                   "written": report.rank_nbytes, "files": report.files}, f)
    dist.destroy_process_group()


def run_ranks(world: int, layers: int, out: str) -> dict:
    import multiprocessing as mp

    results = os.path.join(out, ".results")
    os.makedirs(results, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, world, layers, out, results)) for r in range(world)]
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


def raw_write(nbytes: int, out: str) -> dict:
    buf = memoryview(bytearray(os.urandom(1 << 20) * 64))
    path = os.path.join(out, "raw.bin")
    seconds = raw_write_fsync(path, nbytes, buf)
    discard_file(path)
    return {"seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=6.0, help="weight size in GiB (default 6, the issue's)")
    parser.add_argument("--ranks", default="1,2,4", help="world sizes to run (default 1,2,4)")
    parser.add_argument("--out", default="./bench-dist", help="scratch folder (created, removed at the end)")
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args()
    layers = max(1, round(args.gib * 16))
    os.makedirs(args.out, exist_ok=True)
    try:
        results = {}
        for world in [int(w) for w in args.ranks.split(",")]:
            print(f"[{time.strftime('%H:%M:%S')}] {world} rank(s)", file=sys.stderr, flush=True)
            results[world] = run_ranks(world, layers, os.path.abspath(args.out))
        nbytes = results[next(iter(results))]["file_nbytes"]
        print(f"[{time.strftime('%H:%M:%S')}] raw", file=sys.stderr, flush=True)
        raw = raw_write(nbytes, args.out)
        head = (f"{'writer':<10} {'seconds':>8} {'GB/s':>6} {'x raw':>6} {'peak+ MiB/rank (max)':>21} "
                f"{'held MiB/rank':>13}")
        lines = [f"weights: {layers * WIDTH * WIDTH * 4 / GiB:.2f} GiB, file {nbytes:,} bytes", head, "-" * len(head)]
        for world, r in results.items():
            peak = max(x["peak_added"] for x in r["ranks"]) / MiB
            held = max(x["local_nbytes"] for x in r["ranks"]) / MiB
            lines.append(f"{f'{world} rank(s)':<10} {r['seconds']:>8.2f} {nbytes / r['seconds'] / 1e9:>6.2f} "
                         f"{r['seconds'] / raw['seconds']:>6.2f} {peak:>21.0f} {held:>13.0f}")
        lines.append(f"{'raw':<10} {raw['seconds']:>8.2f} {nbytes / raw['seconds'] / 1e9:>6.2f} {1.0:>6.2f} "
                     f"{'-':>21} {'-':>13}")
        print("\n".join(lines))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"results": results, "raw": raw}, f, indent=1)
        return 0
    finally:
        shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
