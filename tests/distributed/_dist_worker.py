"""Worker for tests/test_distributed.py: one rank of a gloo group (spawned)."""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch


def full_tensors():
    """The whole tensors every scenario shards: ``{key: tensor}``, fixed seed."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(10, 6, generator=g)
    near = emb.clone()
    near[-1, -1] += 1.0  # same size and first 32 bytes as emb: a dedup candidate, not equal
    return {
        "emb": emb,
        "proj": torch.randn(4, 9, generator=g).to(torch.bfloat16),
        "rep": torch.randn(5, generator=g),
        "emb_copy": emb.clone(),
        "near_emb": near,
    }


PLACEMENTS = {"emb": "shard0", "proj": "shard1", "rep": "replicate", "emb_copy": "shard0", "near_emb": "shard0"}


def rank_tensors(rank: int):
    """Plain tensors only rank ``rank`` holds (every rank's zeros are equal: deduped)."""
    g = torch.Generator().manual_seed(100 + rank)
    return {f"rank{rank}.w": torch.randn(3, 4, generator=g), f"rank{rank}.zeros": torch.zeros(8)}


def tag_of(key: str) -> str:
    return "extra" if key.endswith(".zeros") else "model"


def worker(rank: int, world: int, init_file: str, folder: str, scenario: str, result_dir: str,
           backend: str = "gloo") -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    device = "cpu"
    if backend == "nccl":  # one GPU per rank, set before any collective
        torch.cuda.set_device(rank)
        device = "cuda"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        from ptdstream.distributed import write_data_files
        import ptdstream.distributed.writer as writer

        mesh = init_device_mesh(device, (world,))
        kinds = {"shard0": [Shard(0)], "shard1": [Shard(1)], "replicate": [Replicate()]}
        tensors = {k: distribute_tensor(t.to(device), mesh, kinds[PLACEMENTS[k]]) for k, t in full_tensors().items()}
        tensors.update({k: t.to(device) for k, t in rank_tensors(rank).items()})
        if scenario == "raise" and rank == world - 1:
            def failing(*args, **kwargs):
                raise OSError(28, "No space left on device (injected)")
            writer._write_pieces = failing
        if scenario == "kill" and rank == world - 1:
            def dying(*args, **kwargs):
                os._exit(3)
            writer._write_pieces = dying
        try:
            report = write_data_files(tensors, folder, external_tag=tag_of, alignment=16)
            outcome = f"ok {report.rank_nbytes} {sorted(os.path.basename(p) for p, _ in report.files)}"
        except Exception as e:
            outcome = f"error {type(e).__name__}: {e}"
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write(outcome)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
