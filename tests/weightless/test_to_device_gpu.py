"""A weightless export through the real CUDA backend: every bound weight loaded from the
checkpoint to the GPU once, the mapping never faulted in, upstream's .ptd (needs a GPU)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_DIM = 256
_METHODS = (("b1", 1), ("b2", 2))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(_DIM, _DIM, dtype=torch.bfloat16) for _ in range(2)]).eval()


def _lower(make, export):
    from executorch.backends.cuda.cuda_backend import CudaBackend
    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    programs = {name: export(make(), (torch.randn(b, _DIM, dtype=torch.bfloat16),)) for name, b in _METHODS}
    partitioners = {name: [CudaPartitioner([CudaBackend.generate_method_name_compile_spec(name)])]
                    for name in programs}
    edge = to_edge_transform_and_lower(programs, partitioner=partitioners,
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False))
    return edge.to_executorch()


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32])
def test_weightless_cuda_export_loads_each_weight_once_and_keeps_upstreams_ptd(tmp_path, stored):
    import safetensors.torch as st
    from conftest import mapped_rss, read_folder, reference_files

    import ptdstream

    model = _model()
    path = tmp_path / "w.safetensors"
    st.save_file({k: v.to(stored).contiguous() for k, v in model.state_dict().items()}, path)
    upstream = reference_files(_lower(_model, torch.export.export), str(tmp_path / "upstream"))
    with ptdstream.weights_from(path) as weights, ptdstream.stream_cuda_weights() as stats:
        manager = _lower(lambda: weights.model(_model), weights.export)
        loads = weights.device_loads.stats
        n = len(model.state_dict())
        assert (loads.loaded, loads.reused, loads.left_to_upstream) == (n, n, [])
        assert loads.converted == (n if stored != torch.bfloat16 else 0)
        assert stats.shared_nbytes + stats.twin_nbytes == sum(v.numel() * 2 for v in model.state_dict().values())
        assert stats.copied_nbytes == stats.spilled_nbytes == stats.hosted_nbytes == 0
        assert mapped_rss(path) < (1 << 20)  # no page of the checkpoint's mapping touched
        out = tmp_path / "out"
        out.mkdir()
        ptdstream.save(manager, str(out / "model.pte"))
    ours = read_folder(str(out))
    ptds = sorted(n for n in upstream if n.endswith(".ptd"))
    assert ptds and all(ours[n] == upstream[n] for n in ptds)
    assert ours == reference_files(manager, str(tmp_path / "slow"))
