"""XNNPACK weights tagged into a .ptd are looked up with FlatTensorDataMap::get_data,
which needs no tensor_layout (they have none): verify must accept what the runtime loads."""

from __future__ import annotations

from conftest import export_xnnpack_mlp_tagged, read_folder

from ptdstream.check.structure import check_structure


def test_verify_accepts_xnnpack_weights_without_tensor_layout(tmp_path):
    from executorch.runtime import Runtime

    export_xnnpack_mlp_tagged(tmp_path)
    assert sorted(read_folder(str(tmp_path))) == ["model.pte", "w.ptd"]
    program = Runtime.get().load_program(str(tmp_path / "model.pte"), data_path=str(tmp_path / "w.ptd"))
    program.load_method("forward")  # the runtime loads it
    report = check_structure(str(tmp_path / "model.pte"), [str(tmp_path / "w.ptd")])
    assert report.ok, report.summary()
