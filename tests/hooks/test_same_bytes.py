"""cuda_twins.same_bytes: bitwise equality as torch.equal on the bytes (runs on CPU tensors too)."""

from __future__ import annotations

import pytest
import torch

from ptdstream.hooks.cuda.twins import same_bytes


@pytest.mark.parametrize("start,length", [(0, 64), (8, 48), (1, 63), (3, 8), (0, 7), (0, 0)])
@pytest.mark.parametrize("flip", [None, 0, -1, "middle"])
def test_same_bytes_agrees_with_torch_equal_at_every_alignment(start, length, flip):
    base = torch.randint(0, 256, (80,), dtype=torch.uint8)
    other = base.clone()
    a, b = base[start:start + length], other[start:start + length]
    if flip is not None and length:
        i = length // 2 if flip == "middle" else flip
        b[i] ^= 0x80
    assert same_bytes(a, b) == torch.equal(a, b) == (flip is None or length == 0)


def test_same_bytes_is_bitwise_for_nan_payloads():
    a = torch.tensor([float("nan")] * 4, dtype=torch.float32)
    as_bytes = a.view(torch.uint8)
    assert same_bytes(as_bytes, as_bytes.clone())  # NaN != NaN as floats, equal as bytes


def test_same_bytes_is_false_for_different_lengths():
    a = torch.zeros(16, dtype=torch.uint8)
    assert not same_bytes(a, a[:8])
