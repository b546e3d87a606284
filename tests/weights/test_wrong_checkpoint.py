"""``weights`` with a checkpoint of another model, or of this one under other names: the
first problem says that none of the program's keys is there, with the one prefix map
that finds every key when there is one (not a per-key ``--map`` for each norm)."""

from __future__ import annotations

import os

import pytest
import torch
from _small_exports import model, write_reference
from safetensors.torch import save_file

from ptdstream import CheckpointMismatchError, write_ptd
from ptdstream.weights.write import read_program_weights


@pytest.fixture(scope="module")
def external(tmp_path_factory):
    """The external-constants program (TwoLinear: a.weight, a.bias, b.weight, b.bias) and its state."""
    files = write_reference("external", tmp_path_factory.mktemp("external"))
    state = {k: v.detach().contiguous() for k, v in model("external").state_dict().items()}
    return files["model.pte"], state


def _problems(tmp_path, program, state) -> list[str]:
    ckpt = str(tmp_path / "ck.safetensors")
    save_file(state, ckpt)
    with pytest.raises(CheckpointMismatchError) as info:
        write_ptd(program, ckpt, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["ck.safetensors"]  # nothing written
    return info.value.problems


def test_a_checkpoint_under_another_prefix_gets_the_one_map_that_finds_every_key(external, tmp_path):
    program, state = external
    problems = _problems(tmp_path, program, {"model." + k: v for k, v in state.items()})
    ckpt = tmp_path / "ck.safetensors"
    assert problems[0] == (f"none of the program's 4 keys is in {ckpt}, but each is there under another prefix: "
                           "key_map={'': 'model.'} / --map =model.")
    assert not any("a tied weight saved under its other name" in p for p in problems)
    os.makedirs(tmp_path / "out")
    assert write_ptd(program, str(ckpt), str(tmp_path / "out"), key_map={"": "model."}).keys == 4  # the map works


@pytest.mark.parametrize("names,keys,found", [
    (["model.layers.0.w", "model.norm.w"], ["layers.0.w", "norm.w", "extra"], ("model.", "")),
    (["transformer.h.0.w", "transformer.ln.w"], ["model.h.0.w", "model.ln.w"], ("transformer.", "model.")),
    (["0.weight", "1.bias"], ["other.0.weight", "other.1.bias"], ("", "other.")),
    (["a.w", "b.w"], ["x.a.w", "y.b.w"], None),  # no single prefix finds both
])
def test_the_prefix_map_is_one_rewrite_that_finds_every_name(names, keys, found):
    from ptdstream.weights.check import _prefix_map

    assert _prefix_map(names, set(keys)) == found


def test_a_checkpoint_of_another_model_says_so_first(external, tmp_path):
    """Not ``--map 'a.bias'=...`` for each of five norms of the same shape: the first
    line says that no key is there, with the first names of both."""
    program, _ = external
    keys = list(read_program_weights(program).keys)
    other = {f"norm{i}.weight": torch.zeros(3) for i in range(5)}
    problems = _problems(tmp_path, program, other)
    ckpt = tmp_path / "ck.safetensors"
    assert problems[0] == (f"none of the program's 4 keys is in {ckpt}: a checkpoint of another model? (the "
                           f"program's keys: {keys[0]!r}, {keys[1]!r}, {keys[2]!r}, ...; the checkpoint's: "
                           "'norm0.weight', 'norm1.weight', 'norm2.weight', ...)")
    assert [p.split(" (")[0] for p in problems[1:5]] == [f"missing: {k!r}" for k in keys]
    assert not any("--map" in p for p in problems[1:5])


def test_one_key_missing_still_gets_its_twin(external, tmp_path):
    """When other keys were found, a missing key's unused twin (same dtype and shape)
    is still named: the tied-weight hint stays."""
    program, state = external
    renamed = dict(state)
    renamed["tied.bias"] = renamed.pop("b.bias")
    problems = _problems(tmp_path, program, renamed)
    assert len(problems) == 2 and problems[0].endswith(
        "its checkpoint key 'tied.bias' has its dtype and shape (a tied weight saved under its other name?): "
        "key_map={'b.bias': 'tied.bias'} / --map b.bias=tied.bias")
