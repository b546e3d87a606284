"""The CUDA backend's int4 (torchao Int4WeightOnlyConfig, tile_packed_to_4d, HQQ) inside
weights_from: each weight read from the checkpoint straight to the GPU (``device="cuda"``),
quantized there by torchao's handler, its quantized tensors kept on the GPU; the same
tensors as upstream's quantize_ of the loaded module on the GPU (needs a GPU)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False, dtype=torch.bfloat16),
                               torch.nn.Linear(128, 64, bias=False, dtype=torch.bfloat16)).eval()


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32])
def test_int4_tile_packed_quantized_on_the_gpu_from_the_checkpoint_is_upstreams(tmp_path, stored):
    import safetensors.torch as st
    from torchao.quantization import quantize_
    from torchao.quantization.quant_api import Int4WeightOnlyConfig

    import ptdstream
    from ptdstream.weightless import is_storage_less

    config = Int4WeightOnlyConfig(group_size=32, int4_packing_format="tile_packed_to_4d",
                                  int4_choose_qparams_algorithm="hqq")
    path = tmp_path / "w.safetensors"
    st.save_file({k: v.to(stored).contiguous() for k, v in _model().state_dict().items()}, path)
    real = _model()
    real.load_state_dict({k: v.to(torch.bfloat16) for k, v in st.load_file(path).items()})
    real = real.to("cuda")
    quantize_(real, config)
    with ptdstream.weights_from(path) as weights:
        model = weights.model(_model)
        quantize_(model, config, device="cuda")
        assert weights.quantized_keys == ["0.weight", "1.weight"]
        for ours, want in zip(model, real, strict=True):
            got, ref = ours.weight, want.weight
            assert type(got) is type(ref) and not is_storage_less(got)
            names, meta = ref.__tensor_flatten__()
            assert got.__tensor_flatten__()[1] == meta
            for name in names:
                a, b = getattr(got, name), getattr(ref, name)
                assert a.device.type == "cuda" and (a.dtype, a.shape) == (b.dtype, b.shape)
                assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8)
                                   if b.element_size() == 1 else b), name
