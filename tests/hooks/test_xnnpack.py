"""xnnpack_constants_by_reference: XNNPACK's lowering keeps unchanged weights as
references to their storages, not bytes copies; the files do not change."""

from __future__ import annotations

import hashlib

import torch
from _bytecode import global_users as _global_users
from conftest import Mlp, TiedLM, export, read_folder, reference_files

import ptdstream
from ptdstream.hooks.emitter import StorageReference
from ptdstream.hooks.xnnpack import xnnpack_constants_by_reference
from ptdstream.upstream import adapter as _upstream


def _named_buffers(manager):
    return list(_upstream.manager_parts(manager).named_data.buffers)


def test_fp32_weights_are_references_and_the_files_are_upstreams(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    plain = export(model, xnnpack=True)
    with xnnpack_constants_by_reference():
        by_ref = export(model, xnnpack=True)
    refs = [b for b in _named_buffers(by_ref) if isinstance(b, StorageReference)]
    plain_buffers = _named_buffers(plain)
    # mix.weight, mix.bias, head.weight (= embed.weight, tied): each XNNPACK constant, none copied
    assert len(refs) == len(plain_buffers) == 3
    assert sorted(len(r) for r in refs) == sorted(len(b) for b in plain_buffers) == [256, 64 * 64 * 4, 512 * 64 * 4]
    # (references to the partition's copy: executorch's to_backend deep-copies the program before preprocess)
    # the reference kept is the one hashed for the key: SHA-256 cached, its xxh3-128 handed to the save
    # (before: a second, never-hashed reference per weight)
    for r in refs:
        assert _upstream.cached_sha256(r) is not None
        assert r.source.expectation.fingerprint is not None
    # the key XNNPACK names each constant by is the SHA-256 of its bytes, as without the context
    keys = sorted(_upstream.manager_parts(by_ref).named_data.pte_data)
    assert keys == sorted(_upstream.manager_parts(plain).named_data.pte_data)
    assert keys == sorted(hashlib.sha256(bytes(b)).hexdigest() for b in plain_buffers)
    want = reference_files(plain, str(tmp_path / "plain"))
    assert reference_files(by_ref, str(tmp_path / "upstream-writer")) == want
    (tmp_path / "saved").mkdir()
    ptdstream.save(by_ref, str(tmp_path / "saved" / "model.pte"))
    assert read_folder(str(tmp_path / "saved")) == want


def test_other_threads_and_after_exit_copy_as_upstream():
    torch.manual_seed(0)
    with xnnpack_constants_by_reference():
        pass
    after = export(Mlp(), xnnpack=True)
    assert not any(isinstance(b, StorageReference) for b in _named_buffers(after))
    module = _upstream.xnnpack_node_visitor_module()
    assert "bytes" not in vars(module) and "hashlib" in vars(module)
    assert module.get_param_tensor.__module__ != "ptdstream.hooks.xnnpack"


class Conv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)

    def forward(self, x):
        return self.conv(x)


def test_converted_weights_are_copied(tmp_path):
    """XNNPACK converts a conv weight to channels-last (a new tensor): that one is
    copied as upstream does; the bias goes through unchanged and is a reference."""
    torch.manual_seed(0)
    model = Conv()
    inputs = (torch.randn(1, 3, 8, 8),)
    with xnnpack_constants_by_reference():
        manager = export(model, xnnpack=True, inputs=inputs)
    plain = export(model, xnnpack=True, inputs=inputs)
    got = {len(b): type(b).__name__ for b in _named_buffers(manager)}
    assert got == {8 * 3 * 3 * 3 * 4: "bytes", 8 * 4: "StorageReference"}
    assert reference_files(manager, str(tmp_path / "a")) == reference_files(plain, str(tmp_path / "b"))


def test_node_visitor_copies_constants_only_where_expected():
    """The context shadows ``bytes`` in XNNPACK's node visitor module: only the two
    constant serializers may read it, and ``get_param_tensor`` must be the module's global."""
    module = _upstream.xnnpack_node_visitor_module()
    assert sorted(set(_global_users(module, "bytes"))) == ["get_quant_params", "get_serialized_buffer_index"]
    assert sorted(set(_global_users(module, "get_param_tensor"))) == ["get_serialized_buffer_index"]
