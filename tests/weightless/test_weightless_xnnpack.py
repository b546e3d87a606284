"""weights_from with XNNPACK, weights tagged to a .ptd: the same bytes as the export on
real weights, XNNPACK's constants kept by reference, its partition copy sharing
only the bound tensors."""

from __future__ import annotations

import warnings

import pytest
import torch
from _checkpoints import save_checkpoint, state_of
from conftest import Mlp, TiedLM, example_inputs, read_folder

import ptdstream
from ptdstream.upstream import adapter
from ptdstream.weightless import weights_from

warnings.filterwarnings("ignore")


def _seeded(cls):
    torch.manual_seed(0)
    return cls().eval()


def _save(manager, folder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    ptdstream.save(manager, str(folder / "model.pte"))


def _xnnpack_tagged(program, inputs):
    """The lifted program's weights tagged into ``w.ptd`` (``delegate_external_constants_pass_unlifted``),
    re-exported, lowered to XNNPACK and emitted."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

    unlifted = program.module()
    delegate_external_constants_pass_unlifted(unlifted, gen_tag_fn=lambda node: "w")
    return torch.export.export(unlifted, inputs, strict=False), lambda p: to_edge_transform_and_lower(
        p, partitioner=[XnnpackPartitioner()]).to_executorch(ExecutorchBackendConfig())


@pytest.mark.parametrize("cls", [Mlp, TiedLM], ids=["mlp", "tied"])
def test_xnnpack_tagged_weights_save_the_real_exports_bytes(tmp_path, cls):
    real = _seeded(cls)
    inputs = example_inputs(real)
    program, lower = _xnnpack_tagged(torch.export.export(real, inputs, strict=False), inputs)
    _save(lower(program), tmp_path / "real")
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        fake, lower = _xnnpack_tagged(torch.export.export(weights.model(cls), inputs, strict=False), inputs)
        weights.bind(fake)
        manager = lower(fake)
        blobs = adapter.manager_parts(manager).named_data.buffers
        assert blobs and all(getattr(b, "file_mapped", False) for b in blobs)  # XNNPACK kept references
        _save(manager, tmp_path / "weightless")
    got = read_folder(str(tmp_path / "weightless"))
    assert sorted(got) == ["model.pte", "w.ptd"]
    assert got == read_folder(str(tmp_path / "real"))


def test_xnnpack_partition_copy_shares_only_bound_weights(tmp_path):
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    real = _seeded(Mlp)
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    plain = torch.export.export(real, example_inputs(real))
    with weights_from(ckpt) as weights:
        bound = weights.export(weights.model(Mlp), example_inputs(real))
        shared = XnnpackBackend.copy_exported_program_for_preprocess(bound, [])
        assert shared is not bound and shared.graph_module is not bound.graph_module
        assert all(shared.state_dict[k] is t for k, t in bound.state_dict.items())
        copied = XnnpackBackend.copy_exported_program_for_preprocess(plain, [])  # not bound: copied
        assert not any(copied.state_dict[k] is t for k, t in plain.state_dict.items())
    assert "copy_exported_program_for_preprocess" not in vars(XnnpackBackend)
    after = XnnpackBackend.copy_exported_program_for_preprocess(bound, [])
    assert not any(after.state_dict[k] is t for k, t in bound.state_dict.items())

