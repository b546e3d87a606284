"""A ``torch.save`` value that is an expanded view (``Tensor.expand``: a zero stride)
is written as upstream writes the value: its ``.contiguous()`` bytes, row-major
(upstream's emitter makes a constant that is neither contiguous nor channels-last
contiguous), through ``ptdstream weights`` and through ``weights_from``; the
files equal upstream's for the model holding the contiguous value."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import Mlp, example_inputs, export, read_folder, reference_files
from executorch.exir import ExecutorchBackendConfig

PTD = "_default_external_constant.ptd"


def _expanded_state(model):
    """The model's state dict with l1.weight (32 x 64) an expanded view of one row, and
    l2.bias (8) of one element; the model's own weights set to their contiguous values."""
    torch.manual_seed(0)
    row, one = torch.randn(64), torch.randn(1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["l1.weight"], state["l2.bias"] = row.expand(32, 64), one.expand(8)
    assert state["l1.weight"].stride() == (0, 1) and state["l2.bias"].stride() == (0,)
    model.load_state_dict({k: v.contiguous() for k, v in state.items()})
    return state


@pytest.fixture
def case(tmp_path):
    """(folder with the reference export A/ and its program, the torch.save checkpoint, the model)."""
    torch.manual_seed(1)
    model = Mlp().eval()
    state = _expanded_state(model)
    path = tmp_path / "ckpt.pt"
    torch.save(state, path)
    assert torch.load(path, mmap=True, weights_only=True)["l1.weight"].stride() == (0, 1)  # saved as a view
    reference = reference_files(export(model, config=ExecutorchBackendConfig(external_constants=True)),
                                str(tmp_path / "A"))
    return tmp_path, str(path), model, reference


def test_ptdstream_weights_writes_an_expanded_view_as_upstream_writes_its_contiguous_value(case, capsys):
    from ptdstream.cli import main

    folder, ckpt, _, reference = case
    capsys.readouterr()
    rc = main(["weights", str(folder / "A" / "model.pte"), "--from", ckpt, "-o", str(folder / "out"), "-q"])
    assert (rc, capsys.readouterr().err) == (0, "")
    assert os.listdir(folder / "out") == [PTD]
    assert (folder / "out" / PTD).read_bytes() == reference[PTD]


def test_weights_from_writes_an_expanded_view_as_upstream_writes_its_contiguous_value(case):
    import ptdstream
    from ptdstream.weightless import weights_from

    folder, ckpt, model, reference = case
    from executorch.exir import to_edge

    with weights_from(ckpt) as weights:
        manager = to_edge(weights.export(weights.model(Mlp), example_inputs(model))).to_executorch(
            ExecutorchBackendConfig(external_constants=True))
        (folder / "weightless").mkdir()
        ptdstream.save(manager, str(folder / "weightless" / "model.pte"))
    assert read_folder(str(folder / "weightless")) == reference
