"""constants_by_reference: the emitter keeps references to the weights, not bytes copies; the files do not change."""

from __future__ import annotations

import copy
import ctypes
import hashlib
import pickle
import threading

import pytest
import torch
from executorch.exir import ExecutorchBackendConfig

import ptdstream
from ptdstream import _upstream
from ptdstream.constants import StorageReference, reference
from ptdstream.verify import verify_against_manager

from conftest import Mlp, TiedLM, WithBuffer, example_inputs, export, mapped_rss, read_folder, reference_files


def _constants(manager):
    parts = _upstream.manager_parts(manager)
    buffers = [b.storage for b in parts["program"].constant_buffer]
    buffers += [b.storage for b in parts["mutable_data"] or []]
    return buffers + list(parts["external_constant_buffer"])


CASES = {
    "mlp": (Mlp, {}),
    "mlp-external": (Mlp, {"external_constants": True}),
    "tied": (TiedLM, {}),
    "tied-external": (TiedLM, {"external_constants": True}),
    "mutable-buffer": (WithBuffer, {}),
    "mutable-buffer-external": (WithBuffer, {"external_constants": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_by_reference_files_equal_upstream_copies(case, tmp_path):
    model_cls, config = CASES[case]
    torch.manual_seed(0)
    model = model_cls().eval()
    upstream = reference_files(export(model, config=ExecutorchBackendConfig(**config)), str(tmp_path / "up"))
    with ptdstream.constants_by_reference():
        manager = export(model, config=ExecutorchBackendConfig(**config))
    constants = [c for c in _constants(manager) if len(c)]
    assert constants and all(isinstance(c, StorageReference) for c in constants)
    addresses = {p.data_ptr() for p in model.state_dict().values()}
    assert any(ctypes.addressof(c) in addresses for c in constants), "no reference points into the model"

    (tmp_path / "ours").mkdir()
    ptdstream.save(manager, str(tmp_path / "ours" / "model.pte"))
    assert read_folder(str(tmp_path / "ours")) == upstream
    assert reference_files(manager, str(tmp_path / "slow")) == upstream, "upstream's writer, same manager"
    reports = verify_against_manager(manager, str(tmp_path / "ours" / "model.pte"), chunk_nbytes=100)
    assert reports and all(r.ok for r in reports), [r.summary() for r in reports]


def test_two_methods_sharing_weights(tmp_path):
    torch.manual_seed(0)
    model = Mlp().eval()
    methods = {"forward": (model, example_inputs(model)), "batch4": (model, (torch.randn(4, 64),))}
    config = ExecutorchBackendConfig(external_constants=True)
    upstream = reference_files(export(methods, config=config), str(tmp_path / "up"))
    with ptdstream.constants_by_reference():
        manager = export(methods, config=config)
    (tmp_path / "ours").mkdir()
    ptdstream.save(manager, str(tmp_path / "ours" / "model.pte"))
    assert read_folder(str(tmp_path / "ours")) == upstream


def test_patch_is_scoped_and_nests():
    module = _upstream.emitter_module()
    real = module._Emitter._tensor_spec_to_evalue
    assert "bytes" not in vars(module)
    with ptdstream.constants_by_reference():
        with ptdstream.constants_by_reference():
            assert module.bytes is not bytes
        assert module.bytes is not bytes, "still active in the outer context"
    assert "bytes" not in vars(module) and module._Emitter._tensor_spec_to_evalue is real


def test_other_threads_emit_bytes():
    seen = {}

    def other():
        seen["manager"] = export(Mlp())

    with ptdstream.constants_by_reference():
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
    constants = [c for c in _constants(seen["manager"]) if len(c)]
    assert constants and all(type(c) is bytes for c in constants)


def test_reference_reads_in_place_and_copies_as_itself():
    t = torch.arange(1000, dtype=torch.float32)
    ref = reference(t.untyped_storage())
    data = t.numpy().tobytes()
    assert len(ref) == 4000 and ctypes.addressof(ref) == t.data_ptr()
    assert hashlib.sha256(ref).digest() == ref.sha256() == hashlib.sha256(data).digest()
    assert ref.prefix(8) == data[:8] and ref.to_bytes() == data
    assert copy.deepcopy(ref) is ref and copy.copy(ref) is ref
    assert pickle.loads(pickle.dumps(ref)) == data
    t[0] = 7.0  # a reference sees later writes (the documented caveat)
    assert ref.prefix(4) == torch.tensor([7.0]).numpy().tobytes()


def test_reference_refuses_non_cpu_storage():
    with pytest.raises(ValueError, match="needs a CPU storage, got one on meta"):
        reference(torch.empty(4, device="meta").untyped_storage())


def test_memory_mapped_checkpoint_is_paged_out_and_saved_identically(tmp_path):
    from ptdstream.constants import MappedTensorSource

    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)]  # 64 MiB of fp32 weights
    model = torch.nn.Sequential(*layers).eval()
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save(model.state_dict(), checkpoint)
    config = ExecutorchBackendConfig(external_constants=True)
    upstream = reference_files(export(model, config=config, inputs=(torch.randn(1, 1024),)), str(tmp_path / "up"))

    with torch.device("meta"):
        mapped = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)]).eval()
    mapped.load_state_dict(torch.load(checkpoint, mmap=True, weights_only=True), assign=True)
    assert mapped_rss(checkpoint) < 1 << 20  # nothing read yet
    with ptdstream.constants_by_reference():
        manager = export(mapped, config=config, inputs=(torch.randn(1, 1024),))
    constants = [c for c in _constants(manager) if len(c)]
    assert len(constants) == 16 and all(c.file_mapped for c in constants)
    assert all(isinstance(c.source, MappedTensorSource) for c in constants)
    # Paged out after the emitter's SHA-256: at most a few MiB of the 64 MiB it read stay mapped in
    # (paging out is advice: a page under read-ahead or in a large folio may stay).
    assert mapped_rss(checkpoint) <= 4 << 20
    (tmp_path / "ours").mkdir()
    ptdstream.save(manager, str(tmp_path / "ours" / "model.pte"), chunk_nbytes=1 << 20)
    # Each piece is copied into the ring, then its pages are paged out.
    assert mapped_rss(checkpoint) <= 4 << 20
    assert read_folder(str(tmp_path / "ours")) == upstream


def test_xnnpack_export_unchanged(tmp_path):
    """XNNPACK packs its weights itself; whatever constants the emitter still sees are by reference."""
    torch.manual_seed(0)
    model = TiedLM().eval()
    upstream = reference_files(export(model, xnnpack=True), str(tmp_path / "up"))
    with ptdstream.constants_by_reference():
        manager = export(model, xnnpack=True)
    assert all(isinstance(c, StorageReference) for c in _constants(manager) if len(c))
    (tmp_path / "ours").mkdir()
    ptdstream.save(manager, str(tmp_path / "ours" / "model.pte"))
    assert read_folder(str(tmp_path / "ours")) == upstream
