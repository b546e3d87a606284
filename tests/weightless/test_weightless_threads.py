"""weights_from across threads: a checkpoint rewritten in place while the block is open
is refused by name whatever thread emits the program or saves it (a
``ThreadPoolExecutor`` hand-off), and nothing is written."""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from _checkpoints import safetensors_offset, save_checkpoint, state_of
from conftest import Mlp, example_inputs

import ptdstream
from ptdstream.errors import IntegrityError
from ptdstream.weightless import weights_from

warnings.filterwarnings("ignore")


def _config():
    from executorch.exir import ExecutorchBackendConfig

    return ExecutorchBackendConfig(external_constants=True)


def _checkpoint(tmp_path, dtype=torch.float32) -> str:
    torch.manual_seed(0)
    state = {k: v.to(dtype) for k, v in state_of(Mlp().eval()).items()}
    return save_checkpoint("safetensors", state, tmp_path / "ckpt")


def _scribble(path) -> None:
    with open(path, "r+b") as f:  # in place (same inode and size): the end of the last tensor's data
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["mapped", "converted"])
def test_emission_in_another_thread_after_an_in_place_rewrite_is_refused(tmp_path, dtype):
    """Bound in this thread (to_edge), emitted in a worker (to_executorch): before,
    only this thread's contexts were checked and the rewritten bytes were written."""
    from executorch.exir import to_edge

    ckpt = _checkpoint(tmp_path, dtype)
    out = tmp_path / "out"
    out.mkdir()
    with weights_from(ckpt) as weights, ThreadPoolExecutor(1) as pool:
        edge = to_edge(torch.export.export(weights.model(Mlp), example_inputs(Mlp())))  # bound here
        _scribble(ckpt)
        with pytest.raises(IntegrityError) as caught:
            manager = pool.submit(edge.to_executorch, _config()).result()
            pool.submit(ptdstream.save, manager, str(out / "model.pte")).result()
    message = str(caught.value)
    assert message.startswith(f"checkpoint file {ckpt}: changed after weights_from opened it (device, inode, size, "
                              "modification and change time ("), message
    assert message.endswith(") now), before to_executorch emitted the program (nothing emitted): 4 bound key(s) "
                            "come from it: 'l1.weight', 'l1.bias', 'l2.weight', 'l2.bias'; a checkpoint must not "
                            "change until the save: export again from an unchanged checkpoint"), message
    assert os.listdir(out) == []


def test_save_in_another_thread_after_an_in_place_rewrite_is_refused_naming_the_file(tmp_path):
    """Emitted by reference in the block's thread, saved by a worker: the checkpoint
    file's identity is checked at the save's first read (before, only the digest
    of the bytes read, once all of them were written to temp files)."""
    from executorch.exir import to_edge

    ckpt = _checkpoint(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    with weights_from(ckpt) as weights, ThreadPoolExecutor(1) as pool:
        manager = to_edge(torch.export.export(weights.model(Mlp), example_inputs(Mlp()))).to_executorch(_config())
        _scribble(ckpt)
        with pytest.raises(IntegrityError) as caught:
            pool.submit(ptdstream.save, manager, str(out / "model.pte")).result()
    message = str(caught.value)
    at = safetensors_offset(ckpt, "l1.weight")
    assert message.startswith(f"constant 'l1.weight' (8192 bytes at offset {at:,} of its file) uint8[8192]: "
                              f"its checkpoint file {ckpt} was "
                              "written to after it was opened (device, inode, size, modification and change "
                              "time ("), message
    assert message.endswith(" now); nothing is written from it: a checkpoint must not change while it is saved")
    assert os.listdir(out) == []


def test_a_rewrite_while_another_thread_emits_is_refused_after_the_emission(tmp_path, monkeypatch):
    """The file rewritten while the worker's emitter copies the weights (upstream's
    copy: constants by reference belong to the block's thread): checked again once
    the emitter returns, so no manager holds bytes half old, half new."""
    import threading

    from executorch.exir import to_edge

    from ptdstream.upstream import adapter

    ckpt = _checkpoint(tmp_path)
    emitter = adapter.emitter_class()
    real = emitter._tensor_spec_to_evalue
    main = threading.current_thread()
    rewritten = []

    def rewriting(self, spec, *args, **kwargs):  # the first constant the worker emits: the file changes
        if threading.current_thread() is not main and not rewritten:
            rewritten.append(True)
            _scribble(ckpt)
        return real(self, spec, *args, **kwargs)

    monkeypatch.setattr(emitter, "_tensor_spec_to_evalue", rewriting)
    with weights_from(ckpt) as weights, ThreadPoolExecutor(1) as pool:
        edge = to_edge(torch.export.export(weights.model(Mlp), example_inputs(Mlp())))
        with pytest.raises(IntegrityError) as caught:
            pool.submit(edge.to_executorch, _config()).result()
    assert rewritten == [True]
    message = str(caught.value)
    assert message.startswith(f"checkpoint file {ckpt}: changed after weights_from opened it"), message
    assert message.endswith(") now), while to_executorch emitted the program (its result dropped, nothing written): "
                            "4 bound key(s) come from it: 'l1.weight', 'l1.bias', 'l2.weight', 'l2.bias'; a "
                            "checkpoint must not change until the save: export again from an unchanged checkpoint")


def _captured_names() -> list[str]:
    import torch._dynamo.functional_export as functional_export

    return [n for n in vars(functional_export) if n.startswith("__compiled_fn_")]


def test_captured_graphs_are_dropped_in_a_thread_without_a_context_only_while_one_is_open(tmp_path):
    """hooks.program_caches through the export patch: a strict export in another thread, while a
    context is open, leaves no captured graph behind; the patched function kept past the last exit
    behaves as upstream's (the name stays)."""
    from torch.export import _trace

    torch.manual_seed(0)
    real = Mlp().eval()
    x = example_inputs(real)
    ckpt = save_checkpoint("safetensors", state_of(real), tmp_path / "ckpt")
    before = _captured_names()
    with weights_from(ckpt):
        patched = _trace._export
        with ThreadPoolExecutor(1) as pool:
            program = pool.submit(torch.export.export, real, x, strict=True).result()
        assert _captured_names() == before
    assert torch.equal(program.module()(*x), real(*x))
    assert patched is not _trace._export  # the patch is gone, a reference to it kept
    patched(real, x, {}, strict=True)
    added = [n for n in _captured_names() if n not in before]
    assert len(added) == 1  # upstream's behaviour outside every context
