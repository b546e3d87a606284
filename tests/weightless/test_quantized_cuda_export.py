"""The CUDA backend's int4 weight-only (torchao tile-packed) quantized as the weights stream:
each weight read from the checkpoint to the GPU and quantized there, upstream's .ptd (needs a GPU)."""

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
    return torch.nn.Sequential(*[torch.nn.Linear(_DIM, _DIM, bias=False, dtype=torch.bfloat16)
                                 for _ in range(2)]).eval()


def _int4():
    from torchao.quantization import Int4WeightOnlyConfig

    return Int4WeightOnlyConfig(group_size=32, int4_packing_format="tile_packed_to_4d",
                                int4_choose_qparams_algorithm="hqq")


def _lower(model):
    from executorch.backends.cuda.cuda_backend import CudaBackend
    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    programs = {name: torch.export.export(model, (torch.randn(b, _DIM, dtype=torch.bfloat16, device="cuda"),),
                                          strict=False)
                for name, b in _METHODS}
    partitioners = {name: [CudaPartitioner([CudaBackend.generate_method_name_compile_spec(name)])]
                    for name in programs}
    edge = to_edge_transform_and_lower(programs, partitioner=partitioners,
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False))
    return edge.to_executorch()


def test_int4_tile_packed_quantized_on_the_gpu_as_the_weights_stream_keeps_upstreams_ptd(tmp_path):
    import safetensors.torch as st
    from conftest import read_folder, reference_files
    from torchao.quantization import quantize_

    import ptdstream

    path = tmp_path / "w.safetensors"
    st.save_file({k: v.contiguous() for k, v in _model().state_dict().items()}, path)
    real = _model().cuda()
    quantize_(real, _int4())
    upstream_kind = type(real[0].weight).__name__
    assert upstream_kind.startswith("Int4TilePacked")
    upstream = reference_files(_lower(real), str(tmp_path / "upstream"))
    del real
    with ptdstream.weights_from(path) as weights, ptdstream.stream_cuda_weights():
        model = weights.model(_model)
        quantize_(model, _int4(), device="cuda")
        kinds = {(type(m.weight).__name__, m.weight.device.type) for m in model}
        assert kinds == {(upstream_kind, "cuda")}
        manager = _lower(model)
        out = tmp_path / "out"
        out.mkdir()
        ptdstream.save(manager, str(out / "model.pte"))
    ours = read_folder(str(out))
    ptds = sorted(n for n in upstream if n.endswith(".ptd"))
    assert ptds and all(ours[n] == upstream[n] for n in ptds)
    # the .pte holds the AOTI library compiled in this process: upstream's serializer on the same manager
    assert ours == reference_files(manager, str(tmp_path / "slow"))
