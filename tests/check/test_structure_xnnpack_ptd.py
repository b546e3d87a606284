"""XNNPACK weights tagged into a .ptd are looked up with FlatTensorDataMap::get_data,
which needs no tensor_layout (they have none): verify must accept what the runtime loads."""

from __future__ import annotations

import torch

from conftest import Mlp, read_folder
from ptdstream.check.structure import check_structure


def test_verify_accepts_xnnpack_weights_without_tensor_layout(tmp_path):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted
    from executorch.runtime import Runtime

    torch.manual_seed(0)
    example = (torch.randn(2, 64),)
    unlifted = torch.export.export(Mlp().eval(), example, strict=False).module()
    delegate_external_constants_pass_unlifted(unlifted, gen_tag_fn=lambda node: "w")
    edge = to_edge_transform_and_lower(torch.export.export(unlifted, example, strict=False),
                                       partitioner=[XnnpackPartitioner()])
    manager = edge.to_executorch(ExecutorchBackendConfig())
    with open(tmp_path / "model.pte", "wb") as f:
        manager.write_to_file(f)
    manager.write_tensor_data_to_file(str(tmp_path))
    assert sorted(read_folder(str(tmp_path))) == ["model.pte", "w.ptd"]
    program = Runtime.get().load_program(str(tmp_path / "model.pte"), data_path=str(tmp_path / "w.ptd"))
    program.load_method("forward")  # the runtime loads it
    report = check_structure(str(tmp_path / "model.pte"), [str(tmp_path / "w.ptd")])
    assert report.ok, report.summary()
