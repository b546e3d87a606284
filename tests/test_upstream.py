"""Every upstream private name ptdstream relies on still exists, with the shape used.

When an executorch release renames or reshapes one, this fails loudly, naming it,
before any byte-identity test can fail in a confusing way. The list mirrors
ptdstream/_upstream.py (checked against executorch 1.5.1).
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from ptdstream import _upstream

from conftest import Mlp, export

PRIVATE = [
    ("executorch.exir._serialize._cord", "FileBackedData"),
    ("executorch.exir._serialize._cord", "Cord"),
    ("executorch.exir._serialize._flatbuffer_program", "_program_to_flatbuffer"),
    ("executorch.exir._serialize._flatbuffer_program", "_flatbuffer_to_program"),
    ("executorch.exir._serialize._flatbuffer_program", "_convert_from_flatbuffer_dataclass"),
    ("executorch.exir._serialize._flatbuffer_program", "_patch_generated_flatbuffer_aliases"),
    ("executorch.exir._serialize._serialize", "_extract_external_tensor_layouts"),
    ("executorch.extension.flat_tensor.serialize.serialize", "_serialize_to_flatbuffer"),
    ("executorch.exir._serialize.generated.executorch_flatbuffer.Program", "ProgramT"),
]


@pytest.mark.parametrize("module,name", PRIVATE, ids=[n for _, n in PRIVATE])
def test_private_name_exists(module, name):
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone"


def test_cuda_weight_collector_names_and_signatures():
    collector = _upstream.cuda_weight_collector()
    for name in _upstream.CUDA_COLLECTOR_PATCHED:
        assert hasattr(collector, name), f"cuda_weight_collector.{name} is gone"
    assert list(inspect.signature(collector._write_tensor_storage).parameters) == ["tensor", "path"]
    assert list(inspect.signature(collector.FileBackedData.move_from).parameters) == ["path", "sha256"]
    assert list(inspect.signature(collector.trim_host_memory).parameters) == []
    # materialize looks the three up as module globals, so replacing them reaches it.
    names = collector.CudaWeightCollector.materialize.__code__.co_names
    assert {"_write_tensor_storage", "FileBackedData", "trim_host_memory"} <= set(names)


def _global_users(module, name):
    """Names of the module's functions (methods included) whose code loads the global ``name``."""
    import dis

    def codes(code):
        yield code
        for const in code.co_consts:
            if inspect.iscode(const):
                yield from codes(const)

    functions = [v for v in vars(module).values() if inspect.isfunction(v) and v.__module__ == module.__name__]
    for cls in (v for v in vars(module).values() if inspect.isclass(v) and v.__module__ == module.__name__):
        functions += [f for f in vars(cls).values() if inspect.isfunction(f)]
    for function in functions:
        for code in codes(function.__code__):
            if any(i.opname == "LOAD_GLOBAL" and i.argval == name for i in dis.get_instructions(code)):
                yield function.__name__
                break


def test_emitter_copies_constants_with_one_bytes_call():
    """constants_by_reference shadows ``bytes`` in the emitter module: that must stay
    the one call that copies a constant, inside ``_tensor_spec_to_evalue(self, spec, ...)``."""
    emitter = _upstream.emitter_module()
    method = emitter._Emitter._tensor_spec_to_evalue
    assert list(inspect.signature(method).parameters)[:2] == ["self", "spec"]
    assert {"bytes", "ctypes", "hashlib"} <= set(method.__code__.co_names)
    users = sorted(_global_users(emitter, "bytes"))
    assert users == ["_tensor_spec_to_evalue"], f"other emitter code reads the global 'bytes': {users}"
    assert "bytes" not in vars(emitter), "the emitter defines its own name 'bytes'"


def test_export_verifier_reads_bytes_once_for_delegate_blobs():
    """delegate_blobs_from_files shadows ``bytes`` in torch's export verifier: it must stay
    the processed_bytes check only; and the emitter's _emit_delegate must keep its shape."""
    verifier = _upstream.export_verifier_module()
    assert sorted(_global_users(verifier, "bytes")) == ["_check_graph_module"]
    assert "bytes" not in vars(verifier)
    emit = _upstream.emitter_module()._Emitter._emit_delegate
    assert list(inspect.signature(emit).parameters)[:2] == ["self", "lowered_module"]
    assert "processed_bytes" in emit.__code__.co_names


def test_checked_version_is_installed():
    import executorch.version

    assert executorch.version.__version__.split("+")[0] in _upstream.CHECKED_VERSIONS


def test_manager_fields_and_init_signature():
    from executorch.exir import ExecutorchProgramManager

    params = list(inspect.signature(ExecutorchProgramManager.__init__).parameters)
    assert params[:5] == ["self", "execution_programs", "config_methods", "backend_config", "named_data"]
    manager = export(Mlp())
    parts = _upstream.manager_parts(manager)
    assert parts["ptd_segment_alignment"] == 128
    assert parts["pte_head"][4:8] == b"ET12"
    pte, data = _upstream.reference_cords(manager)
    assert len(pte) > 0 and data == {}
    assert isinstance(manager._pte_data._buffers[0], bytes)


def test_file_backed_data_keeps_its_path(tmp_path):
    from executorch.exir._serialize._cord import FileBackedData

    path = tmp_path / "blob"
    path.write_bytes(b"abc")
    assert _upstream.file_backed_path(FileBackedData(str(path))) == str(path)


def test_stream_cuda_weights_patches_and_restores_the_collector(tmp_path):
    """Runs without a GPU: a CPU storage goes to upstream's own writer, and every
    replaced name is back when the context exits."""
    import torch

    from ptdstream.cuda_backend import stream_cuda_weights

    collector = _upstream.cuda_weight_collector()
    before = {name: vars(collector)[name] for name in _upstream.CUDA_COLLECTOR_PATCHED}
    weight = torch.arange(64, dtype=torch.float32)
    path = str(tmp_path / "w.storage")
    with stream_cuda_weights() as stats:
        assert all(vars(collector)[n] is not before[n] for n in _upstream.CUDA_COLLECTOR_PATCHED)
        digest = collector._write_tensor_storage(weight, path)
        data = collector.FileBackedData.move_from(path, sha256=digest)
    assert (stats.upstream, stats.routed) == (1, 0)
    assert data.to_bytes() == weight.numpy().tobytes() and data.sha256() == digest
    assert {name: vars(collector)[name] for name in _upstream.CUDA_COLLECTOR_PATCHED} == before
    with stream_cuda_weights(trim_host_memory=True):
        assert vars(collector)["trim_host_memory"] is before["trim_host_memory"]
