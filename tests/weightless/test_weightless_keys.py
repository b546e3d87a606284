"""weights_from edges: untied names that key_map sends to one checkpoint key, and a
storage-less model that outlives its block."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from _checkpoints import save_checkpoint, state_of
from conftest import read_folder
from test_weightless import _lower, _real_files, _save

from ptdstream.errors import StateError
from ptdstream.weightless import BindingError, UnboundConstantError, is_storage_less, weights_from

warnings.filterwarnings("ignore")
INPUTS = (torch.randn(2, 8),)


class Two(torch.nn.Module):
    """Two untied layers, the second one in ``dtype``."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8, dtype=dtype)

    def forward(self, x):
        return self.b(self.a(x).to(self.b.weight.dtype))


def _two_layers(dtype: torch.dtype = torch.float32) -> Two:
    torch.manual_seed(0)
    return Two(dtype).eval()


def test_untied_names_mapped_to_one_key_save_the_real_exports_bytes(tmp_path):
    """``key_map={"b.weight": "a.weight"}``: both layers take that key's tensor (the second
    group used to overwrite the first in the plan, leaving 'a.weight' unbound), and the save
    is the real export of the model whose two weights hold those values."""
    ckpt = save_checkpoint("safetensors", state_of(_two_layers()), tmp_path / "ckpt")
    real = _two_layers()
    with torch.no_grad():
        real.b.weight.copy_(real.a.weight)
    want = _real_files(real, INPUTS, tmp_path / "real")
    with weights_from(ckpt, key_map={"b.weight": "a.weight"}, allow_extra=True) as weights:
        program = weights.export(weights.model(_two_layers), INPUTS)
        assert [k for k, v in program.state_dict.items() if is_storage_less(v)] == []
        assert torch.equal(program.state_dict["a.weight"], program.state_dict["b.weight"])
        _save(_lower(program), tmp_path / "weightless")
    assert read_folder(str(tmp_path / "weightless")) == want


def test_untied_names_of_two_dtypes_mapped_to_one_key_are_refused_by_name(tmp_path):
    """One tensor object cannot be both dtypes: refused naming both FQNs, the key and the file."""
    ckpt = save_checkpoint("safetensors", state_of(_two_layers()), tmp_path / "ckpt")
    with weights_from(ckpt, key_map={"b.weight": "a.weight"}, allow_extra=True) as weights:
        program = torch.export.export(weights.model(lambda: _two_layers(torch.bfloat16)), INPUTS)
        with pytest.raises(BindingError) as e:
            weights.bind(program)
        assert all(is_storage_less(v) for v in program.state_dict.values())  # nothing bound
    assert (f"dtype: 'b.weight' and 'a.weight' both map to key 'a.weight' ({ckpt}), but the export holds them "
            "as torch.bfloat16 and torch.float32: map them to keys of their own with key_map") in str(e.value)


def test_a_model_exported_after_the_block_is_refused_by_name_at_emission(tmp_path):
    """The model outlived its block: to_executorch raised upstream's 'NULL pointer
    access'; now UnboundConstantError names each constant, and the advice says what
    else than a missing bind leaves one unbound."""
    ckpt = save_checkpoint("safetensors", state_of(_two_layers()), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        model = weights.model(_two_layers)
    program = torch.export.export(model, INPUTS)
    with pytest.raises(UnboundConstantError) as e:
        _lower(program)
    assert e.value.names == ["forward: 'a.bias'", "forward: 'a.weight'", "forward: 'b.bias'", "forward: 'b.weight'"]
    assert str(e.value) == (
        "to_executorch: 4 constant(s) hold no bytes (storage-less, never bound to a checkpoint tensor): "
        "forward: 'a.bias', forward: 'a.weight', forward: 'b.bias', forward: 'b.weight'; export, lower and "
        "emit inside the weights_from block, where each program is bound as it reaches lowering (or by "
        "weights.bind(exported_program)); a program lowered or emitted after the block stays unbound, as does a "
        "constant a pass made from storage-less values")
    assert os.listdir(tmp_path) == ["ckpt"]  # nothing written


def test_export_after_the_block_names_export(tmp_path):
    ckpt = save_checkpoint("safetensors", state_of(_two_layers()), tmp_path / "ckpt")
    with weights_from(ckpt) as weights:
        model = weights.model(_two_layers)
    with pytest.raises(StateError) as e:
        weights.export(model, INPUTS)
    assert str(e.value) == (f"{ckpt}: weights_from(...).export() called after its with block ended: "
                            "call it inside the block")
