"""Every upstream private name ptdstream relies on still exists, with the shape used.

When an executorch release renames or reshapes one, this fails loudly, naming it,
before any byte-identity test can fail in a confusing way. The lists come from
the registry in ptdstream/upstream/names.py (checked against executorch 1.5.1);
another test keeps every private name ptdstream uses in that registry.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import os
import pathlib

import pytest
from _bytecode import global_users as _global_users
from conftest import Mlp, export

import ptdstream
from ptdstream.upstream import adapter as _upstream
from ptdstream.upstream import names


def _installed(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("entry", names.NAMES, ids=[f"{n.module}:{n.attribute}" for n in names.NAMES])
def test_private_name_exists(entry):
    if entry.module.startswith(("executorch.backends.cuda", "transformers")) and not _installed(entry.module):
        pytest.skip(f"{entry.module} is not importable here (CUDA backend, or ptdstream[hf])")
    assert entry.resolve() is not None, f"{entry.module}.{entry.attribute} is gone"


def test_private_fields_exist_on_real_objects(tmp_path):
    """Every FIELDS entry is an attribute of a real object of its owner type, and the
    FileBackedData fields ptdstream sets are exactly the ones upstream's __init__ sets."""
    from executorch.exir._serialize._cord import FileBackedData

    manager = export(Mlp())
    path = tmp_path / "blob"
    path.write_bytes(b"abc")
    objects = {
        "executorch.exir.ExecutorchProgramManager": manager,
        "executorch.exir._serialize._cord.Cord": manager._pte_data,
        "executorch.exir._serialize._cord.FileBackedData": FileBackedData(str(path)),
    }
    for entry in names.FIELDS:
        assert hasattr(objects[entry.owner], entry.field), f"{entry.owner}.{entry.field} is gone"
    file_fields = {e.field for e in names.FIELDS if e.owner.endswith("FileBackedData")}
    assert file_fields == set(_upstream.FILE_BACKED_FIELDS)
    assert set(vars(objects["executorch.exir._serialize._cord.FileBackedData"])) == file_fields
    blank = FileBackedData.__new__(FileBackedData)
    _upstream.init_file_backed(blank, str(path), 3)
    assert blank.to_bytes() == b"abc" and len(blank) == 3 and blank.sha256() == hashlib.sha256(b"abc").digest()


def test_every_private_upstream_name_in_the_package_is_registered():
    """Outside ptdstream/upstream/ (the door), no module imports a private executorch or torch
    module or name; inside it, every private module imported is registered."""
    registered = {n.module for n in names.NAMES} | {f"{n.module}.{n.attribute}".rstrip(".") for n in names.NAMES}
    package = pathlib.Path(ptdstream.__file__).parent
    outside, unregistered = [], []
    for path in package.rglob("*.py"):
        rel = path.relative_to(package).as_posix()
        if "_fb/" in rel:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for mod in mods:
                if mod.split(".")[0] not in ("executorch", "torch"):
                    continue
                if any(part.startswith("_") for part in mod.split(".")):
                    if not rel.startswith("upstream/"):
                        outside.append(f"{rel}: {mod}")
                    elif mod not in registered:
                        unregistered.append(f"{rel}: {mod}")
    assert outside == [], f"private executorch/torch names imported outside ptdstream/upstream/: {outside}"
    assert unregistered == [], f"private names not in ptdstream/upstream/names.py: {unregistered}"


def test_cuda_weight_collector_names_and_signatures():
    collector = _upstream.cuda_weight_collector()
    for name in _upstream.CUDA_COLLECTOR_PATCHED:
        assert hasattr(collector, name), f"cuda_weight_collector.{name} is gone"
    assert list(inspect.signature(collector._write_tensor_storage).parameters) == ["tensor", "path"]
    assert list(inspect.signature(collector.FileBackedData.move_from).parameters) == ["path", "sha256"]
    assert list(inspect.signature(collector.trim_host_memory).parameters) == []
    # stream_cuda_weights wraps materialize to learn the storages of each round.
    assert list(inspect.signature(collector.CudaWeightCollector.materialize).parameters) == [
        "self", "weights", "directory", "device_type_for_weight"]
    # materialize looks the three up as module globals, so replacing them reaches it.
    names = collector.CudaWeightCollector.materialize.__code__.co_names
    assert {"_write_tensor_storage", "FileBackedData", "trim_host_memory"} <= set(names)


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

    assert executorch.version.__version__.split("+")[0] in names.CHECKED_VERSIONS


def test_manager_fields_and_init_signature():
    from executorch.exir import ExecutorchProgramManager

    params = list(inspect.signature(ExecutorchProgramManager.__init__).parameters)
    assert params[:5] == ["self", "execution_programs", "config_methods", "backend_config", "named_data"]
    manager = export(Mlp())
    parts = _upstream.manager_parts(manager)
    assert parts.ptd_segment_alignment == 128
    assert parts.pte_head[4:8] == b"ET12"
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

    from ptdstream.hooks.cuda.backend import stream_cuda_weights

    collector = _upstream.cuda_weight_collector()
    before = {name: vars(collector)[name] for name in _upstream.CUDA_COLLECTOR_PATCHED}
    materialize = vars(collector.CudaWeightCollector)["materialize"]
    weight = torch.arange(64, dtype=torch.float32)
    path = str(tmp_path / "w.storage")
    with stream_cuda_weights() as stats:
        assert all(vars(collector)[n] is not before[n] for n in _upstream.CUDA_COLLECTOR_PATCHED)
        assert vars(collector.CudaWeightCollector)["materialize"] is not materialize
        digest = collector._write_tensor_storage(weight, path)
        data = collector.FileBackedData.move_from(path, sha256=digest)
    assert (stats.upstream, stats.routed) == (1, 0)
    assert data.to_bytes() == weight.numpy().tobytes() and data.sha256() == digest
    assert {name: vars(collector)[name] for name in _upstream.CUDA_COLLECTOR_PATCHED} == before
    assert vars(collector.CudaWeightCollector)["materialize"] is materialize
    with stream_cuda_weights(trim_host_memory=True):
        assert vars(collector)["trim_host_memory"] is before["trim_host_memory"]


def test_stream_cuda_weights_refuses_a_nested_context_and_an_unusable_spill_dir_at_entry(tmp_path):
    """Runs without a GPU: both are refused before any lowering, and nothing stays patched."""
    import re

    from ptdstream.hooks.cuda.backend import stream_cuda_weights

    collector = _upstream.cuda_weight_collector()
    before = {name: vars(collector)[name] for name in _upstream.CUDA_COLLECTOR_PATCHED}
    with stream_cuda_weights():
        with pytest.raises(RuntimeError, match="stream_cuda_weights is already active in this process"):
            with stream_cuda_weights(device_copy_budget_nbytes=0):
                pass
    (tmp_path / "a file").write_bytes(b"")
    for bad in (tmp_path / "missing", tmp_path / "a file"):
        with pytest.raises(OSError, match=rf"spill folder {re.escape(str(bad))}: cannot create a spill file there"):
            with stream_cuda_weights(spill_dir=str(bad)):
                pass
    with stream_cuda_weights(spill_dir=str(tmp_path)):
        pass
    assert os.listdir(tmp_path) == ["a file"]
    assert {name: vars(collector)[name] for name in _upstream.CUDA_COLLECTOR_PATCHED} == before
