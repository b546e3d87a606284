"""brk2: cuda_twins.same_bytes against torch.equal on the bytes (CPU; claim 6)."""

from __future__ import annotations

import pytest
import torch

from ptdstream.hooks.cuda.twins import same_bytes


def _eq(a, b):
    try:
        return same_bytes(a, b)
    except RuntimeError as e:  # a refusal is not an answer
        return f"raised {e}"


@pytest.mark.parametrize("start", [0, 1, 7, 8, 16])
@pytest.mark.parametrize("length", [0, 1, 8, 15, 16, 24, 64])
@pytest.mark.parametrize("other_start", [0, 3, 8])
def test_brk2_same_bytes_at_mixed_alignments(start, length, other_start):
    base = torch.randint(0, 256, (128,), dtype=torch.uint8)
    other = torch.zeros(128, dtype=torch.uint8)
    other[other_start:other_start + length] = base[start:start + length]
    a, b = base[start:start + length], other[other_start:other_start + length]
    assert _eq(a, b) is True
    if length:
        b[-1] ^= 1
        assert _eq(a, b) is False


@pytest.mark.parametrize("step", [2, 8])
def test_brk2_same_bytes_of_strided_byte_views(step):
    """A 1-D uint8 view with stride != 1 (every other byte): the int64 path's view() refuses it."""
    base = torch.randint(0, 256, (16 * step,), dtype=torch.uint8)
    a = base[::step]
    b = a.clone()
    assert a.numel() % 8 == 0 and a.data_ptr() % 8 == 0
    assert _eq(a, b) is torch.equal(a, b) is True


def test_brk2_same_bytes_of_an_expanded_view():
    a = torch.tensor([7], dtype=torch.uint8).expand(16)
    b = torch.full((16,), 7, dtype=torch.uint8)
    assert _eq(a, b) is torch.equal(a, b) is True
