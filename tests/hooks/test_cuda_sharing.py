"""One copy of the weights through lowering (``hooks/cuda/sharing.py``), on a CPU
program and a stand-in for executorch's ``CudaBackend`` (runs without a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import Mlp

from ptdstream.hooks.cuda import sharing
from ptdstream.hooks.cuda.backend import CudaWeightStream
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
