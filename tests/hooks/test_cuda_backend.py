"""executorch's real CUDA backend (AOTI) with weights routed through ptdstream (needs a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _lower(model, routed: bool):
    from executorch.backends.cuda.cuda_backend import CudaBackend
    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from ptdstream.hooks.cuda.backend import stream_cuda_weights

    programs = {
        name: torch.export.export(
            model, (torch.randn(batch, 256, dtype=torch.bfloat16, device="cuda"),), strict=True
        )
        for name, batch in (("forward", 1), ("prefill", 4))
    }
    partitioners = {
        name: [CudaPartitioner([CudaBackend.generate_method_name_compile_spec(name)])]
        for name in programs
    }
    context = stream_cuda_weights() if routed else None
    with context if context is not None else _nothing() as stats:
        edge = to_edge_transform_and_lower(
            programs, partitioner=partitioners,
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
        )
        manager = edge.to_executorch()
    return manager, stats


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_routed_weights_give_upstream_bytes(tmp_path):
    from conftest import read_folder, reference_files

    import ptdstream

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)
    ).to(torch.bfloat16).cuda().eval()
    upstream_manager, _ = _lower(model, routed=False)
    upstream = reference_files(upstream_manager, str(tmp_path / "upstream"))
    manager, stats = _lower(model, routed=True)
    assert stats.routed >= 2 and stats.routed_nbytes >= 2 * 256 * 256 * 2
    # Both methods share every storage: the second reuses the first's source, and
    # each storage is served by the model's own parameter (no device copy kept).
    assert stats.copied_nbytes == 0
    assert (stats.twin_nbytes + stats.shared_nbytes) * 2 == stats.routed_nbytes
    out = tmp_path / "out"
    out.mkdir()
    ptdstream.save(manager, str(out / "model.pte"))
    ours = read_folder(str(out))
    slow = reference_files(manager, str(tmp_path / "slow"))
    assert ours == slow, "ptdstream's fast path equals upstream's serializer on the same manager"
    weights = [n for n in upstream if n.endswith(".ptd")]
    assert weights and sorted(weights) == sorted(n for n in ours if n.endswith(".ptd"))
    for name in weights:
        assert ours[name] == upstream[name], f"{name} differs from the unrouted export"
    assert os.listdir(out) == sorted(ours)


def test_equal_storages_share_one_copy_and_probe_twins_stay_apart(tmp_path):
    """The collector's per-storage hook: equal content -> one device copy and one
    digest; same size and same sampled bytes but one other byte -> two copies, two digests."""
    from ptdstream.hooks.cuda.backend import stream_cuda_weights
    from ptdstream.hooks.cuda.twins import PROBE_NBYTES
    from ptdstream.upstream.adapter import cuda_weight_collector

    collector = cuda_weight_collector()
    n = 1 << 20
    base = torch.zeros(n, dtype=torch.uint8, device="cuda")
    twin = base.clone()
    twin[12345] = 7  # between two sampled positions: the probes are equal
    assert 12345 % ((n - 1) // (PROBE_NBYTES - 1)) != 0
    digests = []
    with stream_cuda_weights() as stats:
        for i, t in enumerate((base, base.clone(), twin, twin.clone())):
            path = str(tmp_path / f"s{i}")
            open(path, "wb").close()
            digests.append(collector._write_tensor_storage(t, path))
            data = collector.FileBackedData.move_from(path, sha256=digests[-1])
            assert len(data) == n and not os.path.exists(path)
            assert data.source._flat().data_ptr() not in (base.data_ptr(), twin.data_ptr())
    assert digests[0] == digests[1] != digests[2] == digests[3]
    assert (stats.routed, stats.routed_nbytes, stats.copied_nbytes) == (4, 4 * n, 2 * n)
    assert collector._write_tensor_storage.__name__ == "_write_tensor_storage"
