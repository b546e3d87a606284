"""constants_by_reference: the emitter keeps references to the weights, not bytes copies; the files do not change."""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
import threading

import pytest
import torch
from conftest import Mlp, TiedLM, WithBuffer, example_inputs, export, mapped_rss, read_folder, reference_files
from executorch.exir import ExecutorchBackendConfig

import ptdstream
from ptdstream.check.compare import verify_against_manager
from ptdstream.hooks.emitter import StorageReference, reference
from ptdstream.upstream import adapter as _upstream


def _constants(manager):
    parts = _upstream.manager_parts(manager)
    buffers = [b.storage for b in parts.program.constant_buffer]
    buffers += [b.storage for b in parts.mutable_data or []]
    return buffers + list(parts.external_constant_buffer)


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
    assert any(c.source._tensor.data_ptr() in addresses for c in constants), "no reference points into the model"

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
    from ptdstream.hooks.interop import EMITTER_HASHLIB

    t = torch.arange(1000, dtype=torch.float32)
    ref = reference(t.untyped_storage())
    data = t.numpy().tobytes()
    assert len(ref) == 4000 and ref.source._tensor.data_ptr() == t.data_ptr()
    assert EMITTER_HASHLIB.sha256(ref).digest() == ref.sha256() == hashlib.sha256(data).digest()
    assert ref.source.expectation.fingerprint.nbytes == 4000
    with pytest.raises(TypeError):
        memoryview(ref)  # no raw view of memory it does not own
    assert ref.prefix(8) == data[:8] and ref.to_bytes() == data
    assert copy.deepcopy(ref) is ref and copy.copy(ref) is ref
    assert pickle.loads(pickle.dumps(ref)) == data
    t[0] = 7.0  # a reference sees later writes (the documented caveat)
    assert ref.prefix(4) == torch.tensor([7.0]).numpy().tobytes()


def test_reference_refuses_non_cpu_storage():
    with pytest.raises(ValueError, match="needs a CPU storage, got one on meta"):
        reference(torch.empty(4, device="meta").untyped_storage())


def test_memory_mapped_checkpoint_is_paged_out_and_saved_identically(tmp_path):
    from ptdstream.sources.mapped import MappedTensorSource

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


def _by_reference(model, config=None, inputs=None):
    with ptdstream.constants_by_reference():
        return export(model, config=config or ExecutorchBackendConfig(external_constants=True),
                      inputs=inputs or (torch.randn(1, 1024),))


def test_weights_changed_after_emission_are_refused_naming_the_key(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 16), torch.nn.Linear(16, 16)).eval()
    manager = _by_reference(model)
    with torch.no_grad():
        model[1].weight.zero_()
    with pytest.raises(ptdstream.IntegrityError, match=r"'1\.weight'.*changed after it was handed over"):
        ptdstream.save(manager, str(tmp_path / "model.pte"))
    assert os.listdir(tmp_path) == [], "nothing published, no temp file left"


def test_moved_or_freed_storage_is_read_where_it_is_now_or_refused(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False)).eval()
    manager = _by_reference(model)
    expected = reference_files(manager, str(tmp_path / "before"))
    model[0].weight.untyped_storage().resize_(8 << 20)  # grown: reallocated, the first 4 MiB kept
    junk = [torch.full((1 << 20,), 7.0) for _ in range(8)]  # reuse the freed block
    (tmp_path / "moved").mkdir()
    ptdstream.save(manager, str(tmp_path / "moved" / "model.pte"))
    assert read_folder(str(tmp_path / "moved")) == expected
    model[0].weight.untyped_storage().resize_(0)  # freed (FSDP-style)
    with pytest.raises(ptdstream.IntegrityError, match=r"storage holds 0 bytes, 4194304 needed"):
        ptdstream.save(manager, str(tmp_path / "moved" / "model.pte"))
    with pytest.raises(ptdstream.IntegrityError):
        pickle.dumps(_constants(manager))  # an error, never a read of freed memory
    assert read_folder(str(tmp_path / "moved")) == expected, "the previous files are untouched"
    del junk


def test_exit_from_another_thread_removes_the_patch():
    module = _upstream.emitter_module()
    context = ptdstream.constants_by_reference()
    context.__enter__()
    worker = threading.Thread(target=context.__exit__, args=(None, None, None))
    worker.start()
    worker.join()
    assert "bytes" not in vars(module) and module.hashlib is hashlib
    assert type(export(Mlp())._emitter_output.program.constant_buffer[1].storage) is bytes


def test_asyncio_tasks_outside_the_context_emit_bytes():
    import asyncio

    async def inside(started):
        with ptdstream.constants_by_reference():
            started.set()
            await asyncio.sleep(0.05)

    async def main():
        started = asyncio.Event()
        task = asyncio.create_task(inside(started))
        await started.wait()
        manager = export(Mlp())  # another task, while the first is inside
        await task
        return manager

    constants = [c for c in _constants(asyncio.run(main())) if len(c)]
    assert constants and all(type(c) is bytes for c in constants)


def test_checkpoint_truncated_under_the_mapping_is_refused_not_sigbus(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(2)]).eval()
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save(model.state_dict(), checkpoint)
    with torch.device("meta"):
        mapped = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(2)]).eval()
    mapped.load_state_dict(torch.load(checkpoint, mmap=True, weights_only=True), assign=True)
    manager = _by_reference(mapped)
    data = checkpoint.read_bytes()
    offsets = [data.find(layer.weight.detach().numpy().tobytes()) for layer in model]
    os.truncate(checkpoint, 4096)
    (tmp_path / "out").mkdir()
    with pytest.raises(ptdstream.IntegrityError, match=r"checkpoint file .*checkpoint\.pt was truncated") as e:
        ptdstream.save(manager, str(tmp_path / "out" / "model.pte"))
    assert os.listdir(tmp_path / "out") == []
    assert str(e.value).startswith(f"constant '0.weight' (4194304 bytes at offset {offsets[0]:,} of its file) "
                                   f"uint8[4194304]: its checkpoint file {checkpoint} was truncated")


def test_a_weight_changed_to_equal_another_is_refused_not_merged(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)).eval()
    manager = _by_reference(model, inputs=(torch.randn(1, 16),))
    with torch.no_grad():
        model[1].weight.copy_(model[0].weight)  # now equal: the save would merge it away
    with pytest.raises(ptdstream.IntegrityError, match=r"constant '1\.weight' .*changed after it was handed over"):
        ptdstream.save(manager, str(tmp_path / "model.pte"))
    assert os.listdir(tmp_path) == []


def test_checkpoint_replaced_by_rename_still_saves_the_mapped_weights(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256)).eval()
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save(model.state_dict(), checkpoint)
    expected = reference_files(export(model, inputs=(torch.randn(1, 256),)), str(tmp_path / "up"))
    with torch.device("meta"):
        mapped = torch.nn.Sequential(torch.nn.Linear(256, 256)).eval()
    mapped.load_state_dict(torch.load(checkpoint, mmap=True, weights_only=True), assign=True)
    manager = _by_reference(mapped, config=ExecutorchBackendConfig(), inputs=(torch.randn(1, 256),))
    torch.save({"other": torch.zeros(3)}, tmp_path / "new.pt")
    os.replace(tmp_path / "new.pt", checkpoint)  # what checkpoint writers do
    (tmp_path / "out").mkdir()
    ptdstream.save(manager, str(tmp_path / "out" / "model.pte"))
    assert read_folder(str(tmp_path / "out")) == expected
