"""brk2: adversarial GPU probes of stream_cuda_weights and same_bytes (need a GPU; < 20 s).

Written without a GPU by brk2; the lead runs them. Each test's docstring says what it
expects and why it might fail.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _ring():
    from ptdstream.sources import BufferRing

    return BufferRing(1 << 20, count=2)


def _bytes_of(source):
    return b"".join(bytes(p) for p in source.pieces(_ring()))


def _materialize(collector, weights, folder):
    """One method through upstream's materialize: ({fqn: source}, {fqn: storage key sha})."""
    artifact = collector.CudaWeightCollector().materialize(
        {fqn: (t, None) for fqn, t in weights.items()}, str(folder), lambda t: 1)
    sources, digests = {}, {}
    for e in artifact.entries:
        data = artifact.storages[e.storage_key]
        sources[e.fqn] = data.source
        digests[e.fqn] = getattr(data, "_sha256", None)  # the key handed upstream
    return sources, digests


def _rand(n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)


def _collector():
    from ptdstream.upstream.adapter import cuda_weight_collector

    return cuda_weight_collector()


def test_brk2_two_fqns_sharing_one_storage_and_a_size_change_keep_byte_equality_classes(tmp_path):
    """Method 1: a, b distinct. Method 2: a and b share ONE storage holding b's old bytes
    (fqn_of maps the pointer to one FQN only). Method 3: a grows (same prefix). Every
    source must hold exactly its storage's bytes; equal bytes share one source."""
    from ptdstream.hooks.cuda.backend import stream_cuda_weights

    collector = _collector()
    n = (1 << 20) + 24
    a0, b0 = _rand(n, 1), _rand(n, 2)
    with stream_cuda_weights(twins=False) as stats:
        m1, _ = _materialize(collector, {"a": a0.clone(), "b": b0.clone()}, tmp_path)
        shared = b0.clone()
        m2, _ = _materialize(collector, {"a": shared, "b": shared}, tmp_path)
        grown = torch.cat([a0, _rand(4096, 3)])
        m3, _ = _materialize(collector, {"a": grown.clone(), "b": b0.clone()}, tmp_path)
    assert m2["a"] is m1["b"] and m2["b"] is m1["b"]
    assert m3["b"] is m1["b"] and m3["a"] is not m1["a"]
    assert _bytes_of(m1["a"]) == bytes(a0.cpu().numpy())
    assert _bytes_of(m3["a"]) == bytes(grown.cpu().numpy())
    assert stats.copied_nbytes == sum(-(-k // 512) * 512 for k in (n, n, grown.numel()))  # allocator blocks


def test_brk2_zero_byte_storages_route_copy_and_save(tmp_path):
    """0-byte storages in two methods, with a budget already used up and budget 0."""
    from ptdstream import StreamingNamedDataStore
    from ptdstream.hooks.cuda.backend import stream_cuda_weights
    from ptdstream.save import write_data_files

    collector = _collector()
    empty = torch.empty(0, dtype=torch.uint8, device="cuda")
    x = _rand(4096, 4)
    for budget in (0, 4096):
        with stream_cuda_weights(twins=False, device_copy_budget_nbytes=budget, spill_dir=str(tmp_path)) as stats:
            m1, _ = _materialize(collector, {"z": empty.clone(), "x": x.clone(), "z2": empty.clone()}, tmp_path)
            m2, _ = _materialize(collector, {"z": empty.clone(), "x": x.clone()}, tmp_path)
        assert m1["z"].nbytes == 0 and m2["z"] is m1["z"] and m1["z2"] is m1["z"]
        assert stats.copied_nbytes + stats.spilled_nbytes == 4096
        store, plain = StreamingNamedDataStore(), StreamingNamedDataStore()
        for k, src in m1.items():
            store.add_named_data(k, src, alignment=16, external_tag="w")
            plain.add_named_data(k, _bytes_of(src), alignment=16, external_tag="w")
        out_a, out_b = tmp_path / f"a{budget}", tmp_path / f"b{budget}"
        out_a.mkdir(), out_b.mkdir()
        write_data_files(store, str(out_a))
        write_data_files(plain, str(out_b))
        assert (out_a / "w.ptd").read_bytes() == (out_b / "w.ptd").read_bytes()


def test_brk2_device_memory_of_the_copies_stays_within_the_budget(tmp_path):
    """256 storages of 4 bytes, budget 4096 bytes: their nbytes (1 KiB) fit, but each
    clone takes a 512-byte block of the caching allocator (128 KiB of device memory).
    The budget counts the allocator's blocks, so 8 copies fit and the rest spill."""
    from ptdstream.hooks.cuda.backend import stream_cuda_weights

    collector = _collector()
    weights = {f"s{i}": _rand(4, 100 + i) for i in range(256)}
    with stream_cuda_weights(twins=False, device_copy_budget_nbytes=4096, spill_dir=str(tmp_path)):
        _materialize(collector, {"warm": _rand(4, 9)}, tmp_path)  # fingerprint matrices cached
    torch.cuda.synchronize()
    with stream_cuda_weights(twins=False, device_copy_budget_nbytes=4096, spill_dir=str(tmp_path)) as stats:
        before = torch.cuda.memory_allocated()
        _materialize(collector, weights, tmp_path)
        torch.cuda.synchronize()
        added = torch.cuda.memory_allocated() - before
    assert stats.copied_nbytes <= 4096
    assert added <= 4096, f"copies take {added} bytes of device memory with a budget of 4096"


def test_brk2_spilled_bytes_are_found_by_a_later_equal_storage_under_any_fqn(tmp_path):
    """Budget 0: everything spilled. A later method's storage equal to a spilled one
    (other FQN; and same FQN after a differently sized storage) reuses it."""
    from ptdstream.hooks.cuda.backend import stream_cuda_weights
    from ptdstream.hooks.cuda.spill import SpilledSource

    collector = _collector()
    n = (2 << 20) + 3
    a, b = _rand(n, 5), _rand(n, 6)
    with stream_cuda_weights(twins=False, device_copy_budget_nbytes=0, spill_dir=str(tmp_path)) as stats:
        m1, _ = _materialize(collector, {"a": a.clone(), "b": b.clone()}, tmp_path)
        m2, _ = _materialize(collector, {"x": b.clone(), "a": _rand(7, 7)}, tmp_path)
        m3, _ = _materialize(collector, {"a": a.clone(), "y": b.clone()}, tmp_path)
    assert isinstance(m1["a"], SpilledSource)
    assert m2["x"] is m1["b"] and m3["a"] is m1["a"] and m3["y"] is m1["b"]
    assert stats.spilled_nbytes == 2 * n + 7
    assert _bytes_of(m3["y"]) == bytes(b.cpu().numpy())
    assert os.listdir(tmp_path) == []


def test_brk2_a_parameter_changed_between_methods_is_refused_at_the_save_naming_the_key(tmp_path):
    """Method 1's storage is served by parameter p (twin, bytes X); p is then changed in
    place to Y and method 2's storage for the same FQN holds Y. The FQN shortcut compares
    with the twin's current bytes and hands method 2 method 1's source (fingerprint of X),
    so upstream gives both one key; the save then refuses the changed twin, naming the
    key, as it did before the shortcut (when the keys differed but method 1's source was
    refused the same way). Nothing is published."""
    from ptdstream import StreamingNamedDataStore
    from ptdstream.errors import IntegrityError
    from ptdstream.hooks.cuda.backend import stream_cuda_weights
    from ptdstream.save import write_data_files

    collector = _collector()
    n = 1 << 20
    p = torch.nn.Parameter(_rand(n, 8), requires_grad=False)
    with stream_cuda_weights() as stats:
        m1, _ = _materialize(collector, {"w": p.detach().clone()}, tmp_path)
        with torch.no_grad():
            p.add_(1)
        m2, _ = _materialize(collector, {"w": p.detach().clone()}, tmp_path)
    assert stats.twin_nbytes >= n
    out = tmp_path / "out"
    out.mkdir()
    for method in (m1, m2):
        store = StreamingNamedDataStore()
        store.add_named_data("w", method["w"], external_tag="w")
        with pytest.raises(IntegrityError, match=r"'w'.*changed after they were handed to ptdstream"):
            write_data_files(store, str(out))
    assert os.listdir(out) == []


def test_brk2_a_nested_context_is_refused(tmp_path):
    """Outer context: no budget limit. Inner context: budget 0 and its own spill folder,
    which would be left unused (shadowed keeps the first hooks): refused at entry."""
    from ptdstream.hooks.cuda.backend import stream_cuda_weights

    spill = tmp_path / "inner-spill"
    spill.mkdir()
    with stream_cuda_weights(twins=False, device_copy_budget_nbytes=None):
        with pytest.raises(RuntimeError, match="already active in this process"):
            with stream_cuda_weights(twins=False, device_copy_budget_nbytes=0, spill_dir=str(spill)):
                pass


@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_brk2_an_unusable_spill_folder_is_refused_clearly(tmp_path, kind):
    """spill_dir missing or a regular file: the OSError should name spill_dir and say it
    is the spill folder (not a random '.ptdstream-spill-xxxx' name that never existed);
    raised at entry, before any lowering."""
    from ptdstream.hooks.cuda.backend import stream_cuda_weights

    collector = _collector()
    bad = tmp_path / "nope"
    if kind == "a file":
        bad.write_bytes(b"")
    with pytest.raises(OSError) as e:
        with stream_cuda_weights(twins=False, device_copy_budget_nbytes=0, spill_dir=str(bad)):
            _materialize(collector, {"c": _rand(4096, 11)}, tmp_path)
    msg = str(e.value)
    assert str(bad) in msg and "spill" in msg.lower() and ".ptdstream-spill-" not in msg, msg


def test_brk2_contexts_one_after_another_give_independent_correct_sources(tmp_path):
    """Re-entering (sequentially) after a context has exited: the first context's
    sources still read their bytes (its spill file lives with them)."""
    from ptdstream.hooks.cuda.backend import stream_cuda_weights

    collector = _collector()
    a = _rand((1 << 20) + 1, 12)
    with stream_cuda_weights(twins=False, device_copy_budget_nbytes=0, spill_dir=str(tmp_path)):
        m1, _ = _materialize(collector, {"a": a.clone()}, tmp_path)
    with stream_cuda_weights(twins=False, device_copy_budget_nbytes=None, spill_dir=str(tmp_path)):
        m2, _ = _materialize(collector, {"a": a.clone()}, tmp_path)
    import gc

    gc.collect()
    assert _bytes_of(m1["a"]) == _bytes_of(m2["a"]) == bytes(a.cpu().numpy())
    assert m1["a"].gpu_fingerprint() == m2["a"].gpu_fingerprint()


@pytest.mark.parametrize("start,length,other", [(0, 64, 0), (8, 48, 16), (1, 63, 5), (3, 8, 3), (0, 0, 8)])
def test_brk2_same_bytes_on_cuda_at_mixed_alignments(start, length, other):
    from ptdstream.hooks.cuda.twins import same_bytes

    base = _rand(128, 13)
    dst = torch.zeros(128, dtype=torch.uint8, device="cuda")
    dst[other:other + length] = base[start:start + length]
    a, b = base[start:start + length], dst[other:other + length]
    assert same_bytes(a, b) is True
    if length:
        b[length // 2] ^= 1
        assert same_bytes(a, b) is False
    assert same_bytes(a, a.cpu()) is False  # another device: not the same tensor bytes


def test_brk2_same_bytes_on_cuda_strided_view():
    """A stride-2 uint8 view (aligned, numel % 8 == 0): the int64 path cannot view it.
    Expected to FAIL with RuntimeError (torch.equal answers True)."""
    from ptdstream.hooks.cuda.twins import same_bytes

    base = _rand(64, 14)
    a = base[::2]
    assert torch.equal(a, a.clone())
    assert same_bytes(a, a.clone()) is True
