"""A :class:`~ptdstream.weightless.BindingError` advises ``key_map`` only where a map can
help: names missing or extra, never a dtype or a shape."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from ptdstream.weightless import BindingError


def test_a_binding_error_advises_a_key_map_only_for_names():
    """A map fixes names (missing, extra), never a dtype or a shape."""
    shape = "shape: 'l1.bias' <- key 'l1.bias' (ck.safetensors): the checkpoint holds [31], the export needs [32]"
    missing = "missing: 'l2.bias' needs checkpoint key 'l2.bias', which the checkpoint does not hold"
    only_shape = str(BindingError("ck.safetensors", [shape]))
    assert only_shape.endswith(f"\n  {shape}\nfix the checkpoint: it holds these weights in other dtypes or shapes "
                               "than the model (a checkpoint of another configuration?); a key_map cannot change a "
                               "dtype or a shape")
    assert "key_map={fqn" not in only_shape
    assert str(BindingError("ck.safetensors", [shape, missing])).endswith(
        "\nfix the checkpoint, or map names with key_map={fqn: checkpoint key}")


def test_a_shape_mismatch_through_weights_from_gives_no_key_map_advice(tmp_path):
    from conftest import Mlp, example_inputs

    from ptdstream import weights_from

    torch.manual_seed(0)
    state = {k: v.detach().contiguous() for k, v in Mlp().state_dict().items()}
    state["l1.bias"] = torch.zeros(31)
    save_file(state, str(tmp_path / "ck.safetensors"))
    with weights_from(str(tmp_path / "ck.safetensors")) as weights:
        program = torch.export.export(weights.model(Mlp), example_inputs(Mlp()))
        with pytest.raises(BindingError) as caught:
            weights.bind(program)
    assert str(caught.value).endswith("a key_map cannot change a dtype or a shape")
