"""install() routes executorch's save paths through ptdstream, with the same bytes."""

from __future__ import annotations

import io
import os

from conftest import Mlp, export, read_folder, reference_files
from executorch.exir import ExecutorchBackendConfig
from executorch.exir.program._program import ExecutorchProgramManager

from ptdstream.hooks import install as patch


def test_routed_methods_write_reference_bytes(tmp_path):
    config = ExecutorchBackendConfig(external_constants=True, segment_alignment=4096)
    model = Mlp()
    manager = export(model, config=config)
    ref = reference_files(manager, str(tmp_path / "ref"))
    original_save = ExecutorchProgramManager.save
    with patch.installed():
        assert ExecutorchProgramManager.save is not original_save
        routed = export(model, config=config)
        assert routed._ptdstream_backend_config is config
        (tmp_path / "saved").mkdir()
        routed.save(str(tmp_path / "saved" / "model.pte"))
        buf = io.BytesIO()
        routed.write_to_file(buf)
        (tmp_path / "data").mkdir()
        routed.write_tensor_data_to_file(str(tmp_path / "data"))
    assert ExecutorchProgramManager.save is original_save
    assert read_folder(str(tmp_path / "saved")) == ref
    assert buf.getvalue() == ref["model.pte"]
    assert read_folder(str(tmp_path / "data")) == {
        k: v for k, v in ref.items() if k.endswith(".ptd")
    }


def test_routed_save_raises_instead_of_logging(tmp_path):
    manager = export(Mlp())
    with patch.installed():
        try:
            manager.save(str(tmp_path / "missing-folder" / "model.pte"))
        except FileNotFoundError:
            pass
        else:
            raise AssertionError("save into a missing folder must raise")
    assert os.listdir(tmp_path) == []


def test_routed_write_tensor_data_without_data_files_writes_nothing(tmp_path):
    """A program whose weights are all in the .pte: upstream's write_tensor_data_to_file
    writes no file, and so does the routed one (an empty set publishes nothing)."""
    manager = export(Mlp())
    (tmp_path / "ref").mkdir()
    manager.write_tensor_data_to_file(str(tmp_path / "ref"))
    with patch.installed():
        (tmp_path / "routed").mkdir()
        manager.write_tensor_data_to_file(str(tmp_path / "routed"))
    assert os.listdir(tmp_path / "ref") == os.listdir(tmp_path / "routed") == []
