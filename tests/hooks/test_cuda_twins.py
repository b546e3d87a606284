"""CUDA weight storages served by a parameter the process already holds (needs a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from ptdstream.errors import IntegrityError

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _hand_over(collector, tensor, path):
    open(path, "wb").close()
    digest = collector._write_tensor_storage(tensor, path)
    return collector.FileBackedData.move_from(path, sha256=digest)


def test_storage_equal_to_a_held_parameter_references_it_and_adds_no_device_memory(tmp_path):
    from ptdstream.hooks.cuda.backend import stream_cuda_weights
    from ptdstream.upstream.adapter import cuda_weight_collector

    collector = cuda_weight_collector()
    n = 3 << 20
    param = torch.nn.Parameter(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"), requires_grad=False)
    plain = torch.randint(0, 256, (n // 2,), dtype=torch.uint8, device="cuda")  # no Parameter holds it
    aoti = param.detach().clone()  # upstream's AOTI copy: same bytes, its own storage
    with stream_cuda_weights() as stats:
        data = _hand_over(collector, aoti, str(tmp_path / "a"))
        other = _hand_over(collector, plain.clone(), str(tmp_path / "b"))
    assert data.source._flat().data_ptr() == param.data_ptr()
    assert other.source._flat().data_ptr() not in (plain.data_ptr(), param.data_ptr())
    assert (stats.twin_nbytes, stats.copied_nbytes) == (n, n // 2)
    assert bytes(b"".join(bytes(p) for p in data.source.pieces(_ring()))) == bytes(param.cpu().numpy())


def test_a_referenced_parameter_changed_before_the_save_is_refused_naming_the_key(tmp_path):
    from ptdstream import StreamingNamedDataStore
    from ptdstream.hooks.cuda.backend import stream_cuda_weights
    from ptdstream.save import write_data_files
    from ptdstream.upstream.adapter import cuda_weight_collector

    collector = cuda_weight_collector()
    n = (1 << 20) + 3
    param = torch.nn.Parameter(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"), requires_grad=False)
    with stream_cuda_weights() as stats:
        data = _hand_over(collector, param.detach().clone(), str(tmp_path / "a"))
    assert stats.twin_nbytes == n
    out = tmp_path / "out"
    out.mkdir()
    store = StreamingNamedDataStore()
    store.add_named_data("layer.weight", data, external_tag="w")
    write_data_files(store, str(out))  # unchanged: saved
    assert (out / "w.ptd").stat().st_size > n
    store2 = StreamingNamedDataStore()
    store2.add_named_data("layer.weight", data, external_tag="w")
    with torch.no_grad():
        param[n // 2] += 1  # neither the first 32 bytes nor the size change
    out2 = tmp_path / "out2"
    out2.mkdir()
    with pytest.raises(IntegrityError, match=r"layer\.weight.*w\.ptd.*changed after they were handed to ptdstream"):
        write_data_files(store2, str(out2))
    assert os.listdir(out2) == []


def _blocks(nbytes):
    """Device memory of a copy: whole 512-byte blocks of the caching allocator."""
    return -(-nbytes // 512) * 512


def _ring():
    from ptdstream.sources import BufferRing

    return BufferRing(1 << 20, count=2)


def _materialize(collector, weights, folder):
    """One method's AOTI weights through upstream's ``materialize``: {fqn: source}."""
    artifact = collector.CudaWeightCollector().materialize(
        {fqn: (t, None) for fqn, t in weights.items()}, str(folder), lambda t: 1)
    by_fqn = {e.fqn: e.storage_key for e in artifact.entries}
    return {fqn: artifact.storages[key].source for fqn, key in by_fqn.items()}


def test_later_methods_reuse_the_source_kept_for_their_fqn_and_compare_other_bytes_in_full(tmp_path):
    from ptdstream.hooks.cuda.backend import stream_cuda_weights
    from ptdstream.upstream.adapter import cuda_weight_collector

    collector = cuda_weight_collector()
    n = (1 << 20) + 8
    p0, p1 = (torch.nn.Parameter(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"),
                                 requires_grad=False) for _ in range(2))
    const = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")  # no Parameter holds it
    with stream_cuda_weights() as stats:
        first = _materialize(collector, {"a": p0.clone(), "b": p1.clone(), "c": const.clone()}, tmp_path)
        assert (stats.twin_nbytes, stats.copied_nbytes) == (2 * n, _blocks(n))
        second = _materialize(collector, {"a": p0.clone(), "b": p1.clone(), "c": const.clone()}, tmp_path)
        assert all(second[k] is first[k] for k in "abc")  # same sources, nothing kept twice
        # "a" now holds b's bytes, "b" bytes nobody holds that differ from b's in one byte only.
        changed = p1.detach().clone()
        changed[n // 2] += 1
        third = _materialize(collector, {"a": p1.clone(), "b": changed, "c": const.clone()}, tmp_path)
    assert third["a"] is first["b"] and third["c"] is first["c"]
    assert third["b"] is not first["b"]
    assert (stats.twin_nbytes, stats.copied_nbytes) == (2 * n, 2 * _blocks(n))
    assert bytes(b"".join(bytes(p) for p in third["b"].pieces(_ring()))) == bytes(changed.cpu().numpy())
    assert stats.routed == 9


def test_storages_without_a_twin_beyond_the_budget_are_spilled_and_saved_byte_identical(tmp_path):
    from ptdstream import StreamingNamedDataStore
    from ptdstream.hooks.cuda.backend import stream_cuda_weights
    from ptdstream.hooks.cuda.spill import SpilledSource
    from ptdstream.save import write_data_files
    from ptdstream.upstream.adapter import cuda_weight_collector

    collector = cuda_weight_collector()
    n = (3 << 20) + 5
    consts = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda") for _ in range(3)]
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    before = torch.cuda.memory_allocated()
    with stream_cuda_weights(device_copy_budget_nbytes=_blocks(n), spill_dir=str(spill_dir)) as stats:
        first = _materialize(collector, {f"c{i}": c.clone() for i, c in enumerate(consts)}, tmp_path)
        kept_on_device = torch.cuda.memory_allocated() - before
        # A later method: equal bytes in new storages reuse every source, the spilled ones too.
        second = _materialize(collector, {f"c{i}": c.clone() for i, c in enumerate(consts)}, tmp_path)
        # c2's bytes under another FQN are found by probe and GPU fingerprint.
        third = _materialize(collector, {"other": consts[2].clone()}, tmp_path)
    assert (stats.copied_nbytes, stats.spilled_nbytes, stats.twin_nbytes) == (_blocks(n), 2 * n, 0)
    assert kept_on_device < 2 * n  # one copy kept (plus the clones upstream would free)
    assert not isinstance(first["c0"], SpilledSource)
    assert isinstance(first["c1"], SpilledSource) and isinstance(first["c2"], SpilledSource)
    assert all(second[k] is first[k] for k in first) and third["other"] is first["c2"]
    assert os.listdir(spill_dir) == []  # the spill file has no name

    spilled_store, plain = StreamingNamedDataStore(), StreamingNamedDataStore()
    for i, c in enumerate(consts):
        spilled_store.add_named_data(f"c{i}", first[f"c{i}"], alignment=16, external_tag="w")
        plain.add_named_data(f"c{i}", bytes(c.cpu().numpy()), alignment=16, external_tag="w")
    for name, store in (("a", spilled_store), ("b", plain)):
        (tmp_path / name).mkdir()
        write_data_files(store, str(tmp_path / name))
    assert (tmp_path / "a" / "w.ptd").read_bytes() == (tmp_path / "b" / "w.ptd").read_bytes()


def test_spill_budget_none_keeps_every_copy_on_the_device(tmp_path):
    from ptdstream.hooks.cuda.backend import stream_cuda_weights
    from ptdstream.upstream.adapter import cuda_weight_collector

    collector = cuda_weight_collector()
    consts = [torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda") for _ in range(2)]
    with stream_cuda_weights(device_copy_budget_nbytes=None, twins=False) as stats:
        _materialize(collector, {f"c{i}": c.clone() for i, c in enumerate(consts)}, tmp_path)
    assert (stats.copied_nbytes, stats.spilled_nbytes) == (2 << 20, 0)
