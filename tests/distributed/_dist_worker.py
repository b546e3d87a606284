"""Worker for tests/distributed/test_writer.py: one rank of a gloo group (spawned),
running several writes (scenarios) one after the other in the same group."""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch

#: The process group's timeout, from when every rank is ready: one collective's wait for the
#: others' tiny writes, generous for a loaded machine; a killed rank is seen at once (its
#: connections close), not by this timeout.
GROUP_TIMEOUT_S = 300


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


def edge_tensors(world: int):
    """Scalars and shards that hold no rows: ``{key: (whole tensor, placement)}``."""
    return {
        "scalar": (torch.tensor(3.5), "replicate"),
        "psum": (torch.tensor(world * (world + 1) // 2), "partial"),  # rank r holds r + 1
        "row": (torch.arange(3.0).reshape(1, 3), "shard0"),  # every rank but 0 holds no rows
        "rows3": (torch.arange(6, dtype=torch.int32).reshape(3, 2), "shard0"),  # 4 ranks: 1, 1, 1, 0 rows
        "no_rows": (torch.zeros(0, 4), "shard0"),
        "no_cols": (torch.zeros(4, 0), "shard1"),
    }


def edge_rank_tensors(rank: int):
    """Plain 0-dim and empty tensors only rank ``rank`` holds."""
    return {f"rank{rank}.scalar": torch.tensor(rank + 0.25, dtype=torch.bfloat16),
            f"rank{rank}.empty": torch.zeros(0, dtype=torch.int8)}


def change_tensors(rank: int):
    """Plain tensors of the change scenarios, as handed over: ``shared`` (rank 0) and
    ``shared_copy`` (rank 1) are one dedup class; ``near`` differs from them in byte 500."""
    g = torch.Generator().manual_seed(7)
    shared, mine = torch.randn(256, generator=g), torch.randn(256, generator=g)
    near = shared.clone()
    near.view(torch.uint8)[500] ^= 1
    return {0: {"shared": shared}, 1: {"mine": mine, "shared_copy": shared.clone(), "near": near}}.get(rank, {})


#: scenario: (rank, key, byte flipped, the writer function it is flipped before).
CHANGES = {
    "change-head": (1, "mine", 0, "write_pieces"),
    "change-middle": (1, "mine", 512, "write_pieces"),
    "change-last": (1, "mine", 1023, "write_pieces"),
    "change-dedup-first": (0, "shared", 600, "write_pieces"),
    "change-dedup-second": (1, "shared_copy", 600, "write_pieces"),
    "change-before-fingerprint": (1, "near", 500, "collate"),
}


def channels_last() -> torch.Tensor:
    """A 4-D channels_last tensor (dense over its storage, not contiguous), fixed seed."""
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, 3, 2, 2, generator=g).contiguous(memory_format=torch.channels_last)


def _lie(scenario: str, rank: int, mesh):
    """``(tensors, write_data_files keywords)`` of a DTensor whose ranks disagree, or
    whose local tensor is not what its placement gives this rank (``run_check=False``)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    whole = torch.arange(18, dtype=torch.float32).reshape(6, 3)
    half = whole[rank * 3:(rank + 1) * 3].clone()
    shape, local, kwargs = (6, 3), half, {}
    if scenario == "lie-shard-rows":  # Shard(0) of 6 rows over 2 ranks is 3 + 3; the ranks hold 2 + 4
        local = whole[:2].clone() if rank == 0 else whole[2:].clone()
    if scenario == "lie-shape" and rank == 1:  # the same bytes, the whole (2, 9) on rank 1
        shape, local = (2, 9), half.reshape(1, 9)
    if scenario == "lie-dtype" and rank == 1:
        local = half.view(torch.int32)
    if scenario == "lie-tag":
        kwargs["external_tag"] = f"tag{rank}"
    if scenario == "lie-alignment":
        kwargs["alignment"] = 16 if rank == 0 else 64
    if scenario == "channels-last-replicate":
        return {"cl": DTensor.from_local(channels_last(), mesh, [Replicate()], run_check=False)}, kwargs
    if scenario == "channels-last-shard":  # DTensor's strides channels_last, its local shards contiguous
        return {"cl": distribute_tensor(channels_last(), mesh, [Shard(0)])}, kwargs
    if scenario == "channels-last-local":  # rank r holds rows 2r, 2r + 1, channels_last
        local = channels_last()[rank * 2:(rank + 1) * 2]
        return {"cl": DTensor.from_local(local, mesh, [Shard(0)], run_check=False)}, kwargs
    w = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=(shape[1], 1))
    return {"w": w}, kwargs


LIES = ("lie-shard-rows", "lie-shape", "lie-dtype", "lie-tag", "lie-alignment", "channels-last-replicate",
        "channels-last-shard", "channels-last-local")


def tag_of(key: str) -> str:
    return "extra" if key.endswith(".zeros") else "model"


def _tensors(scenario: str, rank: int, world: int, mesh, device: str):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    kinds = {"shard0": [Shard(0)], "shard1": [Shard(1)], "replicate": [Replicate()]}
    if scenario in CHANGES:
        return {k: t.to(device) for k, t in change_tensors(rank).items()}
    if scenario == "edges":
        tensors = {}
        for k, (t, kind) in edge_tensors(world).items():
            if kind == "partial":
                tensors[k] = DTensor.from_local(torch.tensor(rank + 1, device=device), mesh, [Partial()])
            else:
                tensors[k] = distribute_tensor(t.to(device), mesh, kinds[kind])
        tensors.update({k: t.to(device) for k, t in edge_rank_tensors(rank).items()})
        return tensors
    tensors = {k: distribute_tensor(t.to(device), mesh, kinds[PLACEMENTS[k]]) for k, t in full_tensors().items()}
    tensors.update({k: t.to(device) for k, t in rank_tensors(rank).items()})
    return tensors


def _inject(scenario: str, rank: int, world: int, tensors, writer) -> None:
    """Patch ``writer`` for the scenario on this rank (restored by the caller)."""
    if scenario == "raise" and rank == world - 1:
        def failing(*args, **kwargs):
            raise OSError(28, "No space left on device (injected)")
        writer.write_pieces = failing
    if scenario == "raise-everywhere":
        def failing_here(*args, **kwargs):
            raise OSError(28, f"No space left on device (injected on rank {rank})")
        writer.write_pieces = failing_here
    if scenario == "kill" and rank == world - 1:
        def dying(*args, **kwargs):
            os._exit(3)
        writer.write_pieces = dying
    if scenario in CHANGES and CHANGES[scenario][0] == rank:
        _, key, byte, name = CHANGES[scenario]
        original = getattr(writer, name)

        def changing(*args, **kwargs):
            tensors[key].view(torch.uint8)[byte] ^= 1  # after hand-over, in place
            return original(*args, **kwargs)
        setattr(writer, name, changing)


def worker(rank: int, world: int, init_file: str, out_root: str, scenarios, result_dir: str,
           backend: str = "gloo") -> None:
    """Run each scenario's write into ``out_root/<scenario>``; its outcome line goes
    to ``result_dir/<scenario>.rank<rank>``. Every import first, then "ready" in
    ``result_dir/ready`` (``_procs.rank_ready``): the group's timeout counts from
    when every rank is ready, not from a start that four ranks importing torch on
    two busy cores make minutes long."""
    import torch.distributed as dist
    from _procs import rank_ready
    from torch.distributed.device_mesh import init_device_mesh

    import ptdstream.distributed.protocol as writer
    from ptdstream.distributed import write_data_files

    device = "cpu"
    if backend == "nccl":  # one GPU per rank, set before any collective
        torch.cuda.set_device(rank)
        device = "cuda"
    rank_ready(os.path.join(result_dir, "ready"), rank, world)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        mesh = init_device_mesh(device, (world,))
        for scenario in scenarios:
            tensors, kwargs = _lie(scenario, rank, mesh) if scenario in LIES else (
                _tensors(scenario, rank, world, mesh, device), {})
            saved = (writer.write_pieces, writer.collate)
            _inject(scenario, rank, world, tensors, writer)
            try:
                report = write_data_files(tensors, os.path.join(out_root, scenario),
                                          **{"external_tag": tag_of, "alignment": 16, **kwargs})
                names = sorted(os.path.basename(p) for p, _ in report.files)
                outcome = f"ok {report.rank_nbytes} {report.dedup_saved_nbytes} {names}"
            except Exception as e:  # noqa: BLE001 - any failure is the scenario's outcome, checked by the test
                outcome = f"error {type(e).__name__}: {e}"
            finally:
                writer.write_pieces, writer.collate = saved
            with open(os.path.join(result_dir, f"{scenario}.rank{rank}"), "w") as f:
                f.write(outcome)
    except Exception:  # noqa: BLE001 - any failure of the worker: its traceback and exit 1
        traceback.print_exc()
        sys.exit(1)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group a killed peer left broken: nothing to tear down
            pass
