"""One copy of the weights through lowering (``hooks/cuda/sharing.py``), on a CPU
program and a stand-in for executorch's ``CudaBackend`` (runs without a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import Mlp

from ptdstream.hooks.cuda import sharing
from ptdstream.hooks.cuda.routing import CudaWeightStream
from ptdstream.upstream import adapter


class _Backend:
    """What ptdstream relies on of ``CudaBackend``: upstream's default-mode copy
    (a plain deepcopy) and a release that frees every storage of the moved program
    (upstream frees the CUDA ones; these are on the CPU)."""

    released: list = []

    @classmethod
    def copy_exported_program_for_preprocess(cls, edge_program, compile_specs):
        return copy.deepcopy(edge_program)

    @classmethod
    def release_moved_tensors(cls, device_edge_program, compile_specs):
        for values in (device_edge_program.state_dict, device_edge_program.constants):
            for name, tensor in values.items():
                cls.released.append(name)
                tensor.untyped_storage().resize_(0)


def _program():
    torch.manual_seed(0)
    return torch.export.export(Mlp().eval(), (torch.randn(2, 64),))


def _originals():
    return (vars(_Backend)["copy_exported_program_for_preprocess"], vars(_Backend)["release_moved_tensors"])


def _preprocess(program, specs):
    """What AotiBackend.preprocess does to a copy in place: moves (replaces) the
    state dict's entries, here one of them to a new tensor, then releases."""
    program._state_dict["l2.bias"] = program.state_dict["l2.bias"].clone()  # a host tensor "moved"
    moved = program.state_dict["l2.bias"]
    _Backend.release_moved_tensors(program, specs)
    return moved


def test_upstreams_copy_duplicates_every_weight_per_method():
    program = _program()
    copies = [_Backend.copy_exported_program_for_preprocess(program, []) for _ in range(3)]
    for c in copies:
        assert all(c.state_dict[k] is not t and c.state_dict[k].data_ptr() != t.data_ptr()
                   for k, t in program.state_dict.items())


def test_copies_share_the_weights_copy_the_graph_and_keep_them_through_release():
    program = _program()
    before = {k: t.detach().clone() for k, t in program.state_dict.items()}
    specs = [b"method_name=forward"]
    _Backend.released = []
    with sharing.sharing_weights(_Backend):
        copies = [_Backend.copy_exported_program_for_preprocess(program, specs) for _ in range(3)]
        assert sharing.shared_count() == len(program.state_dict)
        for c in copies:
            assert c is not program and c.graph_module is not program.graph_module
            assert c.state_dict is not program.state_dict
            assert [n.name for n in c.graph.nodes] == [n.name for n in program.graph.nodes]
            assert all(c.state_dict[k] is t for k, t in program.state_dict.items())
            assert all(sharing.is_shared(t) for t in c.state_dict.values())
        moved = [_preprocess(c, specs) for c in copies]
        # Each method's moved (new) tensor is released as upstream does; the shared ones are not.
        assert _Backend.released == ["l2.bias"] * 3
        assert all(m.untyped_storage().nbytes() == 0 for m in moved)
        assert program.state_dict["l2.bias"] is not moved[0]  # a copy's dict is its own
        assert specs == [b"method_name=forward"]  # no spec added (low_memory_mode or other)
    for k, t in program.state_dict.items():
        assert t.untyped_storage().nbytes() == before[k].numel() * 4 and torch.equal(t, before[k]), k
    assert _originals() == (vars(_Backend)["copy_exported_program_for_preprocess"],
                            vars(_Backend)["release_moved_tensors"])
    assert sharing.shared_count() == 0 and not sharing.is_shared(program.state_dict["l1.weight"])


def test_exit_restores_upstreams_methods_and_copy():
    originals = _originals()
    with sharing.sharing_weights(_Backend):
        assert _originals() != originals
    assert _originals() == originals
    program = _program()
    c = _Backend.copy_exported_program_for_preprocess(program, [])
    assert c.state_dict["l1.weight"] is not program.state_dict["l1.weight"]


def test_an_error_inside_unregisters_and_restores():
    originals = _originals()
    program = _program()
    with pytest.raises(KeyError, match="boom"):
        with sharing.sharing_weights(_Backend):
            _Backend.copy_exported_program_for_preprocess(program, [])
            assert sharing.shared_count() == len(program.state_dict)
            raise KeyError("boom")
    assert _originals() == originals and sharing.shared_count() == 0


@pytest.mark.parametrize("share", [True, False])
def test_stream_shares_through_the_backend_unless_told_not_to(monkeypatch, share):
    monkeypatch.setattr(adapter, "cuda_backend", lambda: _Backend)
    originals = _originals()
    program = _program()
    stream = CudaWeightStream(share_weights=share)
    stream.open()
    try:
        c = _Backend.copy_exported_program_for_preprocess(program, [])
        assert (c.state_dict["l1.weight"] is program.state_dict["l1.weight"]) is share
        assert (_originals() != originals) is share
    finally:
        stream.close()
    assert _originals() == originals and sharing.shared_count() == 0


def test_stream_opens_without_the_backend_class(monkeypatch):
    def missing():
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(adapter, "cuda_backend", missing)
    with CudaWeightStream() as stats:
        assert stats.shared_nbytes == 0 and sharing.shared_count() == 0


def test_host_weights_are_known_by_name_while_shared():
    program = _program()
    assert sharing.host_weight("l1.weight") is None
    with sharing.sharing_weights(_Backend):
        for _ in range(2):
            _Backend.copy_exported_program_for_preprocess(program, [])
        assert sharing.host_weight("l1.weight") is program.state_dict["l1.weight"]
        assert sharing.host_weight("l2.bias") is program.state_dict["l2.bias"]
        assert sharing.host_weight("nope") is None
        other = _program()  # the same names over other storages: served by neither
        _Backend.copy_exported_program_for_preprocess(other, [])
        assert sharing.host_weight("l1.weight") is None
    assert sharing.host_weight("l2.bias") is None and sharing.shared_count() == 0


def test_equal_to_host_compares_every_piece_exactly():
    from ptdstream.hooks.cuda.hosted import equal_to_host

    torch.manual_seed(1)
    host = torch.randn(1000, dtype=torch.bfloat16)
    flat = host.view(torch.uint8).clone()
    assert equal_to_host(host, flat, compare_nbytes=64)
    flat[1999] ^= 1  # the last byte, in the last piece
    assert not equal_to_host(host, flat, compare_nbytes=64)
    flat[1999] ^= 1
    assert not equal_to_host(host[1:], flat[2:], compare_nbytes=64)  # past storage offset 0
    assert not equal_to_host(host.view(10, 100).t(), flat, compare_nbytes=64)  # not contiguous
    assert not equal_to_host(host[:999], flat[:1998], compare_nbytes=64)  # does not fill its storage
    assert not equal_to_host(host, flat[:1998], compare_nbytes=64)  # other size


def test_a_host_weight_changed_after_lowering_is_refused_at_the_save_naming_the_key(tmp_path):
    import os

    from ptdstream import StreamingNamedDataStore
    from ptdstream.errors import IntegrityError
    from ptdstream.hooks.cuda.hosted import HostWeightSource
    from ptdstream.hooks.interop import SourceBackedData
    from ptdstream.save import write_data_files
    from ptdstream.sources.digest import Fingerprint

    host = torch.arange(4096, dtype=torch.float32)
    gpu = Fingerprint(host.numel() * 4, "gpu-test", b"\x01" * 32)
    source = HostWeightSource(host, "CUDA weight storage (16384 bytes) served from the host weight", gpu)
    assert source.gpu_fingerprint() is gpu and source.expectation.fingerprint is not None
    ok = tmp_path / "ok"
    ok.mkdir()
    store = StreamingNamedDataStore()
    store.add_named_data("w", SourceBackedData(source, sha256=gpu.digest), external_tag="w")
    write_data_files(store, str(ok))
    assert os.listdir(ok) == ["w.ptd"] and host.numpy().tobytes() in (ok / "w.ptd").read_bytes()
    host[7] = -1.0
    out = tmp_path / "out"
    out.mkdir()
    store = StreamingNamedDataStore()
    store.add_named_data("w", SourceBackedData(source, sha256=gpu.digest), external_tag="w")
    with pytest.raises(IntegrityError, match=r"key 'w'.* w\.ptd at offset 256: .*served from the host "
                                             r"weight.*changed after it was handed over"):
        write_data_files(store, str(out))
    assert os.listdir(out) == []


def test_upstreams_lowering_and_release_are_what_the_sharing_relies_on():
    """executorch's lowering makes every method's copy before preprocess_multimethod, and
    CudaBackend's release reads only the moved program's state_dict and constants (so the
    view without the shared tensors is all it frees); read from the source, which needs no
    GPU nor triton."""
    import ast
    import importlib.util
    import inspect
    import pathlib

    from executorch.exir.backend import backend_api

    lower = inspect.getsource(backend_api.lower_all_submodules_to_backend)
    assert lower.index("copy_exported_program_for_preprocess") < lower.index("preprocess_multimethod")
    spec = importlib.util.find_spec("executorch")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "backends" / "cuda" / "cuda_backend.py"
    tree = ast.parse(path.read_text())
    release = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "release_moved_tensors")
    reads = {c.args[1].value for c in ast.walk(release) if isinstance(c, ast.Call)
             and getattr(c.func, "id", None) == "getattr" and isinstance(c.args[1], ast.Constant)}
    attrs = {a.attr for a in ast.walk(release) if isinstance(a, ast.Attribute)
             and isinstance(a.value, ast.Name) and a.value.id == "device_edge_program"}
    assert reads == {"state_dict", "constants"} and attrs == set()
    assert "resize_" in ast.unparse(release)


def test_a_device_copy_of_a_host_weight_is_served_from_the_host_before_any_twin(monkeypatch):
    """A storage whose FQN names a shared host weight with its bytes is served from that
    weight even when a parameter elsewhere in the process (another copy of the model, or
    one not yet collected) holds the same bytes; without the host weight that twin is used."""
    from ptdstream.hooks.cuda.hosted import HostWeightSource
    from ptdstream.sources import cuda_fingerprint
    from ptdstream.sources.digest import Fingerprint

    monkeypatch.setattr(cuda_fingerprint, "gpu_fingerprint",  # no GPU: a stand-in of the same shape
                        lambda flat: Fingerprint(flat.numel(), "test", bytes(flat[:32].tolist()).ljust(32, b"\0")))
    program = _program()
    host = program.state_dict["l1.weight"]
    nbytes = host.numel() * host.element_size()
    twin = torch.nn.Parameter(host.detach().clone())  # the same bytes, held elsewhere

    class _Finder:
        asked = 0

        def find(self, flat, wanted):
            _Finder.asked += 1
            return twin if torch.equal(twin.detach().reshape(-1).view(torch.uint8), flat) else None

    def route(stream, fqn):
        moved = host.detach().clone()  # what move_to_device_pass makes of the host weight
        flat = moved.reshape(-1).view(torch.uint8)
        stream._finder = _Finder()
        return stream._find_or_keep(flat, moved.untyped_storage(), nbytes, [], "unused", False, fqn)

    with sharing.sharing_weights(_Backend):
        _Backend.copy_exported_program_for_preprocess(program, [])
        stream = CudaWeightStream()
        source = route(stream, "l1.weight")
        assert isinstance(source, HostWeightSource) and source._tensor.data_ptr() == host.data_ptr()
        assert (stream.stats.hosted_nbytes, stream.stats.twin_nbytes, stream.stats.copied_nbytes) == (nbytes, 0, 0)
        assert _Finder.asked == 0  # no scan for twins once the host weight holds the bytes
        other = CudaWeightStream()
        source = route(other, "not.a.weight")  # no host weight of that name: the twin
        assert not isinstance(source, HostWeightSource) and _Finder.asked == 1
        assert (other.stats.hosted_nbytes, other.stats.twin_nbytes) == (0, nbytes)


@pytest.mark.parametrize("first_out", ["older", "newer"])
def test_registrations_end_with_their_context_whatever_the_exit_order(first_out):
    """Two contexts open at once: the copy made after one has exited belongs to the
    one still active (the installed patch is the first context's), and is released
    when that one exits; after both, nothing is registered."""
    import contextlib

    originals = _originals()
    program = _program()
    n = len(program.state_dict)
    older, newer = contextlib.ExitStack(), contextlib.ExitStack()
    older.enter_context(sharing.sharing_weights(_Backend))
    newer.enter_context(sharing.sharing_weights(_Backend))
    staying = newer if first_out == "older" else older
    (older if first_out == "older" else newer).close()
    c = _Backend.copy_exported_program_for_preprocess(program, [])
    assert c.state_dict["l1.weight"] is program.state_dict["l1.weight"]  # still shared
    assert sharing.shared_count() == n and sharing.host_weight("l2.bias") is program.state_dict["l2.bias"]
    staying.close()
    assert sharing.shared_count() == 0 and sharing._hosts == {} and sharing._contexts == {}
    assert sharing.host_weight("l2.bias") is None and not sharing.is_shared(program.state_dict["l1.weight"])
    assert _originals() == originals


def test_a_copy_made_while_two_are_active_is_released_by_the_newer_ones_exit():
    program = _program()
    with sharing.sharing_weights(_Backend):
        with sharing.sharing_weights(_Backend):
            _Backend.copy_exported_program_for_preprocess(program, [])
            assert sharing.shared_count() == len(program.state_dict)
        assert sharing.shared_count() == 0 and sharing._hosts == {}
        _Backend.copy_exported_program_for_preprocess(program, [])  # the older one's own
        assert sharing.shared_count() == len(program.state_dict)
    assert sharing.shared_count() == 0 and sharing._contexts == {}
