"""Worker for tests/distributed/test_rank_faults.py: spawn WORLD gloo ranks, each running the
scenarios (ranks that disagree, pieces changed after hand-over, a rank killed) one after another
in one group; each rank's outcome written as text.

usage: python tests/distributed/_rank_faults_worker.py WORLD OUTROOT SCENARIO...
"""
from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch
from _dist_worker import GROUP_TIMEOUT_S


def _scenario(name, rank, world, mesh, writer):
    """-> (tensors, kwargs, restore)"""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    restore = []
    kw = {}
    g = torch.Generator().manual_seed(1)
    full = torch.randn(6, 3, generator=g)
    if name == "lie-shard-sizes":
        # placement Shard(0) of 6 rows over 2 ranks is 3+3; rank 0 holds 2 rows, rank 1 holds 4.
        local = full[:2].clone() if rank == 0 else full[2:].clone()
        t = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([6, 3]), stride=(3, 1))
        return {"w": t}, kw, restore
    if name == "lie-shard-shape-differs":
        # rank 0 says the whole is (6,3), rank 1 says (2,9): same bytes, different shapes
        local = full[rank * 3:(rank + 1) * 3].clone()
        shape = (6, 3) if rank == 0 else (2, 9)
        if rank == 1:
            local = local.reshape(1, 9)
        stride = (shape[1], 1)
        t = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
        return {"w": t}, kw, restore
    if name == "lie-dtype-differs":
        local = full[rank * 3:(rank + 1) * 3].clone()
        if rank == 1:
            local = local.view(torch.int32)
        t = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([6, 3]), stride=(3, 1))
        return {"w": t}, kw, restore
    if name == "lie-replicate-differs":
        # a "Replicate" tensor whose replicas differ: the owner's bytes win silently?
        local = full.clone() if rank == 0 else full.clone() + 1
        t = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
        return {"r": t}, kw, restore
    if name == "lie-tag-differs":
        t = distribute_tensor(full, mesh, [Shard(0)])
        kw["external_tag"] = f"tag{rank}"
        return {"w": t}, kw, restore
    if name == "lie-alignment-differs":
        t = distribute_tensor(full, mesh, [Shard(0)])
        kw["alignment"] = 16 if rank == 0 else 64
        return {"w": t}, kw, restore
    if name == "lie-key-missing":
        t = distribute_tensor(full, mesh, [Shard(0)])
        x = DTensor.from_local((full + 1)[rank * 3:(rank + 1) * 3].clone(), mesh, [Shard(0)], run_check=False,
                               shape=torch.Size([6, 3]), stride=(3, 1))
        return ({"w": t, "x": x} if rank == 0 else {"w": t}), kw, restore
    if name == "lie-key-order":
        a = distribute_tensor(full, mesh, [Shard(0)])
        b = distribute_tensor(full * 2, mesh, [Shard(0)])
        return ({"a": a, "b": b} if rank == 0 else {"b": b, "a": a}), kw, restore
    if name == "lie-plain-and-dtensor":
        if rank == 0:
            return {"w": full.clone()}, kw, restore
        lying = DTensor.from_local(full[3:].clone(), mesh, [Shard(0)], run_check=False,
                                   shape=torch.Size([6, 3]), stride=(3, 1))
        return {"w": lying}, kw, restore
    if name == "lie-folder-differs":
        kw["folder_suffix"] = f"rank{rank}"
        return {f"k{rank}": full.clone() + rank}, kw, restore
    if name == "transposed-replicate":
        base = torch.randn(3, 5, generator=g)
        t = distribute_tensor(base, mesh, [Replicate()])
        t = DTensor.from_local(base.t(), mesh, [Replicate()], run_check=False)
        return {"tt": t}, kw, restore
    if name == "channels-last-replicate":
        cl = torch.randn(2, 3, 2, 2, generator=g).contiguous(memory_format=torch.channels_last)
        t = DTensor.from_local(cl, mesh, [Replicate()], run_check=False)
        assert t.to_local().is_contiguous(memory_format=torch.channels_last)
        return {"cl": t}, kw, restore
    if name in ("change-shard-written", "change-shard-dedup-unwritten", "change-shard-dedup-written"):
        a = distribute_tensor(full.clone(), mesh, [Shard(0)])
        b = distribute_tensor(full.clone(), mesh, [Shard(0)])
        tensors = {"a": a, "b": b}
        if name == "change-shard-written":
            tensors = {"a": a}
        target = "b" if name == "change-shard-dedup-unwritten" else "a"
        if rank == 1:
            original = writer.write_pieces

            def changing(*args, **kwargs):
                tensors[target].to_local().view(-1).view(torch.uint8)[5] ^= 1
                return original(*args, **kwargs)
            writer.write_pieces = changing
            restore.append(lambda: setattr(writer, "write_pieces", original))
        return tensors, kw, restore
    if name == "change-replicate-owner":
        t = distribute_tensor(full.clone(), mesh, [Replicate()])
        import zlib
        owner = zlib.crc32(b"r") % world
        if rank == owner:
            original = writer.write_pieces

            def changing(*args, **kwargs):
                t.to_local().view(-1).view(torch.uint8)[70] ^= 1
                return original(*args, **kwargs)
            writer.write_pieces = changing
            restore.append(lambda: setattr(writer, "write_pieces", original))
        return {"r": t}, kw, restore
    if name == "change-between-describe-and-plan":
        # a non-candidate changed between describe and plan (during the fingerprint step)
        mine = {"m": full.clone()} if rank == 1 else {"z": full.clone() + 5}
        if rank == 1:
            original = writer.collate

            def changing(*args, **kwargs):
                mine["m"].view(-1).view(torch.uint8)[40] ^= 1
                return original(*args, **kwargs)
            writer.collate = changing
            restore.append(lambda: setattr(writer, "collate", original))
        return mine, kw, restore
    if name == "freed-storage":
        mine = {f"p{rank}": full.clone() + rank}
        if rank == 1:
            original = writer.write_pieces

            def freeing(*args, **kwargs):
                mine["p1"].untyped_storage().resize_(0)
                return original(*args, **kwargs)
            writer.write_pieces = freeing
            restore.append(lambda: setattr(writer, "write_pieces", original))
        return mine, kw, restore
    if name == "kill-rank0-in-write":
        mine = {f"p{rank}": full.clone() + rank}
        if rank == 0:
            def dying(*a, **k):
                os._exit(3)
            writer.write_pieces = dying
        return mine, kw, restore
    if name == "kill-rank1-in-plan":
        mine = {f"p{rank}": full.clone() + rank}
        if rank == 0:
            original = writer.plan_files

            def slow(*a, **k):
                import time
                time.sleep(3)
                return original(*a, **k)
            writer.plan_files = slow
            restore.append(lambda: setattr(writer, "plan_files", original))
        if rank == 1:
            import threading
            import time
            threading.Thread(target=lambda: (time.sleep(1.0), os._exit(4)), daemon=True).start()
        return mine, kw, restore
    raise SystemExit(f"unknown scenario {name}")


def worker(rank, world, init_file, out_root, scenarios):
    """One rank: every import, then "ready" in ``out_root/ready`` (``_procs.rank_ready``),
    then the group (its timeout counts from then) and the scenarios."""
    import torch.distributed as dist
    from _procs import rank_ready
    from torch.distributed.device_mesh import init_device_mesh

    import ptdstream.distributed.protocol as writer
    from ptdstream.distributed import write_data_files

    rank_ready(os.path.join(out_root, "ready"), rank, world)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        mesh = init_device_mesh("cpu", (world,))
        for name in scenarios:
            tensors, kw, restore = _scenario(name, rank, world, mesh, writer)
            folder = os.path.join(out_root, name)
            suffix = kw.pop("folder_suffix", None)
            if suffix:
                folder = os.path.join(out_root, name, suffix)
            os.makedirs(folder, exist_ok=True)
            try:
                rep = write_data_files(tensors, folder, **kw)
                outcome = f"ok {sorted(os.path.basename(p) for p, _ in rep.files)}"
            except Exception as e:  # noqa: BLE001 - the outcome file reports any error to the test
                outcome = f"error {type(e).__module__}.{type(e).__name__}: {e}"
            finally:
                for r in restore:
                    r()
            with open(os.path.join(out_root, f"{name}.rank{rank}"), "w") as f:
                f.write(outcome)
    except Exception:  # noqa: BLE001 - the worker reports any failure by its exit status
        traceback.print_exc()
        sys.exit(1)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group may already be gone (a killed peer)
            pass


def main():
    import multiprocessing as mp

    from _procs import wait_ranks

    world, out_root, scenarios = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    os.makedirs(out_root, exist_ok=True)
    ctx = mp.get_context("spawn")
    init = os.path.join(out_root, "pg")
    if os.path.exists(init):
        os.unlink(init)
    procs = [ctx.Process(target=worker, args=(r, world, init, out_root, scenarios)) for r in range(world)]
    for p in procs:
        p.start()
    problem = wait_ranks(procs, os.path.join(out_root, "ready"))
    for name in scenarios:
        for r in range(world):
            path = os.path.join(out_root, f"{name}.rank{r}")
            print(f"{name} rank{r}: {open(path).read() if os.path.exists(path) else None}")
        d = os.path.join(out_root, name)
        print(f"  files: {sorted(os.listdir(d)) if os.path.isdir(d) else None}")
    if problem is not None:
        sys.exit(f"world {world}, scenarios {scenarios}: {problem}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _procs
    main()
