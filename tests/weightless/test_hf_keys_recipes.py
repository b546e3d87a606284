"""The stand-ins transformers' conversion runs on: each operation's recipe (element
ranges of checkpoint keys, in row-major order) gives exactly the tensor the same
operation gives on the real tensors; an operation that reorders elements is not
planned, and says so."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ptdstream.weightless.hf_keys import UNPLANNED, Recipe, planned_type

STATE = {
    "a": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
    "b": torch.arange(100, 124, dtype=torch.float32).reshape(2, 3, 4),
    "c": torch.arange(200, 212, dtype=torch.float32).reshape(2, 3, 2),
}
ENTRIES = {k: SimpleNamespace(shape=tuple(v.shape), dtype=v.dtype, dim_order=tuple(range(v.dim())))
           for k, v in STATE.items()}


def _leaf(key):
    t = STATE[key]
    return planned_type()(Recipe(tuple(t.shape), t.dtype, ((key, 0, t.numel()),)))


def _materialize(recipe: Recipe) -> torch.Tensor:
    flat = [STATE[k].reshape(-1)[start:start + n] for k, start, n in recipe.segments]
    return torch.cat(flat).to(recipe.dtype).reshape(recipe.shape)


OPS = {
    "stack0": lambda a, b, c: torch.stack([a, b], dim=0),
    "stack2": lambda a, b, c: torch.stack([a, b], dim=2),
    "cat0": lambda a, b, c: torch.cat([a, b], dim=0),
    "cat1": lambda a, b, c: torch.cat([a, b], dim=1),
    "cat2_uneven": lambda a, b, c: torch.cat([a, c], dim=2),
    "merge_then_concat": lambda a, b, c: torch.cat([torch.stack([a, b]), torch.stack([b, a])], dim=1),
    "chunk0": lambda a, b, c: torch.chunk(torch.cat([a, b], dim=1), 2, dim=1)[1],
    "split_last": lambda a, b, c: torch.split(a, [1, 3], dim=2)[1],
    "unbind": lambda a, b, c: torch.unbind(b, dim=1)[2],
    "select": lambda a, b, c: a[1],
    "slice": lambda a, b, c: a[:, 1:3],
    "view": lambda a, b, c: a.view(6, 4),
    "to_bf16": lambda a, b, c: torch.cat([a, b], dim=2).to(torch.bfloat16),
    "ellipsis": lambda a, b, c: a[...],
    "unsqueeze_squeeze": lambda a, b, c: a.unsqueeze(1).squeeze(1),
}


@pytest.mark.parametrize("name", list(OPS))
def test_a_planned_operation_gives_the_real_operations_elements(name):
    planned = OPS[name](_leaf("a"), _leaf("b"), _leaf("c"))
    want = OPS[name](STATE["a"], STATE["b"], STATE["c"])
    assert isinstance(planned, planned_type())
    assert planned.recipe.shape == tuple(want.shape) and planned.recipe.dtype == want.dtype
    assert torch.equal(_materialize(planned.recipe), want)


def test_a_recipe_names_its_whole_key_or_its_byte_ranges():
    assert _leaf("a").recipe.whole_key(ENTRIES) == "a"
    fused = torch.cat([_leaf("a"), _leaf("b")], dim=2).recipe
    assert fused.whole_key(ENTRIES) is None
    assert fused.parts(ENTRIES)[:3] == (("a", 0, 16), ("b", 0, 16), ("a", 16, 16))  # float32: 4 bytes each


@pytest.mark.parametrize("op", [lambda a: a.t() if a.dim() == 2 else a.transpose(0, 1),
                                lambda a: a.permute(2, 0, 1), lambda a: a * 2, lambda a: a[:, ::2]])
def test_an_operation_that_reorders_or_computes_is_not_planned(op):
    with pytest.raises(ValueError, match=f"^{UNPLANNED}: aten"):
        op(_leaf("a"))
