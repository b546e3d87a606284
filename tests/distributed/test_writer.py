"""ptdstream.distributed: 1, 2 and 4 gloo ranks write the same bytes as one process;
a failing or killed rank publishes nothing; fingerprints compose across pieces."""

from __future__ import annotations

import os

import pytest
import torch

import _dist_worker as W
from ptdstream.distributed.fingerprint import combine, digest_piece
from ptdstream.save import write_data_files
from ptdstream.store import StreamingNamedDataStore


def _run(world: int, tmp_path, scenario: str = "ok", backend: str = "gloo"):
    """Spawn ``world`` ranks; ``{rank: outcome line}`` (None for a rank that died)."""
    import multiprocessing as mp

    folder, results = tmp_path / "out", tmp_path / "results"
    folder.mkdir(exist_ok=True)
    results.mkdir(exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=W.worker,
                         args=(r, world, str(tmp_path / "pg"), str(folder), scenario, str(results), backend))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            p.join()
    out = {}
    for r in range(world):
        path = results / f"rank{r}"
        out[r] = path.read_text() if path.exists() else None
    return folder, out


def _reference(world: int, folder) -> None:
    """One process: the whole tensors added in the global order, written by write_data_files."""
    store = StreamingNamedDataStore()
    tensors = dict(W.full_tensors())
    for r in range(world):
        tensors.update(W.rank_tensors(r))
    for key, t in tensors.items():
        store.add_named_data(key, t, alignment=16, external_tag=W.tag_of(key))
    write_data_files(store, str(folder))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_write_the_single_process_bytes(tmp_path, world):
    _check_ranks_against_one_process(tmp_path, world, "gloo")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_ranks_over_nccl_write_the_single_process_bytes(tmp_path):
    """Two H200 ranks (NCCL), CUDA DTensor shards: the bytes of one CPU process."""
    _check_ranks_against_one_process(tmp_path, 2, "nccl")


def _check_ranks_against_one_process(tmp_path, world: int, backend: str) -> None:
    folder, outcomes = _run(world, tmp_path, backend=backend)
    assert all(o is not None and o.startswith("ok") for o in outcomes.values()), outcomes
    ref = tmp_path / "ref"
    ref.mkdir()
    _reference(world, ref)
    assert sorted(os.listdir(folder)) == sorted(os.listdir(ref)) == ["extra.ptd", "model.ptd"]
    for name in os.listdir(ref):
        assert (folder / name).read_bytes() == (ref / name).read_bytes(), name
    # Every payload byte was written by exactly one rank (emb_copy and the zeros deduped).
    written = sum(int(o.split()[1]) for o in outcomes.values())
    full = W.full_tensors()
    unique = sum(t.numel() * t.element_size() for k, t in full.items() if k != "emb_copy")
    assert written == unique + world * 3 * 4 * 4 + 8 * 4  # each rank's w, the zeros once


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["raise", "kill"])
def test_a_failing_rank_publishes_nothing(tmp_path, scenario):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "model.ptd").write_bytes(b"previous")
    folder, outcomes = _run(2, tmp_path, scenario)
    assert sorted(os.listdir(folder)) == ["model.ptd"]  # no new file, no temp file left
    assert (folder / "model.ptd").read_bytes() == b"previous"
    if scenario == "raise":
        for o in outcomes.values():
            assert o.startswith("error DistributedWriteError: rank 1: OSError: [Errno 28] No space left on device "
                                "(injected); nothing was published"), o
    else:
        assert outcomes[1] is None, outcomes
        assert outcomes[0].startswith("error DistributedWriteError: the group failed (a rank was killed, timed "
                                      "out or left): RuntimeError: "), outcomes
        assert outcomes[0].endswith("; nothing was published"), outcomes


@pytest.mark.parametrize("cuts", [[], [1], [7, 8, 9], [65535, 65537, 131072], [100000]])
def test_fingerprint_composes_across_any_split(cuts):
    data = bytes(torch.randint(0, 256, (200_003,), generator=torch.Generator().manual_seed(1),
                               dtype=torch.uint8).tolist())
    whole = combine(len(data), [digest_piece([data], 0)])
    bounds = [0] + cuts + [len(data)]
    parts = [digest_piece([data[a:b]], a) for a, b in zip(bounds, bounds[1:])]
    assert combine(len(data), reversed(parts)) == whole
    changed = bytearray(data)
    changed[-1] ^= 1
    assert combine(len(data), [digest_piece([bytes(changed)], 0)]) != whole
    with pytest.raises(ValueError, match="pieces do not tile the buffer: a piece starts at 5, expected 0"):
        combine(len(data), [digest_piece([data[5:]], 5)])


def test_a_plain_tensor_the_single_process_store_refuses_is_refused_by_key():
    """Contiguous or channels_last only, as executorch's TensorLayout.from_tensor
    (and so StreamingNamedDataStore) accepts: a transposed tensor is refused,
    naming its key, before any rank plans or writes."""
    from ptdstream.distributed.writer import _local_pieces
    from ptdstream.errors import LayoutError

    base = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    channels_last = torch.zeros(1, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    infos, _ = _local_pieces({"w": base, "cl": channels_last}, lambda key: "model", 16, 0)
    assert [(i.key, i.dim_order) for i in infos] == [("w", (0, 1)), ("cl", (0, 2, 3, 1))]
    with pytest.raises(LayoutError, match=r"^key 'w.t': Tensor is not contiguous\. Please call \.contiguous\(\)"):
        _local_pieces({"w.t": base.t()}, lambda key: "model", 16, 0)
