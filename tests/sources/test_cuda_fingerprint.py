"""The device fingerprint's formula, checked on CPU tensors against a big-integer reference."""

from __future__ import annotations

import pytest
import torch

from ptdstream.sources import cuda_fingerprint as cf


def reference(data: bytes) -> list[int]:
    """The module docstring's formula in Python integers (coefficients from the module's generators)."""
    words = cf.ROW_NBYTES // 2
    a = cf._row_coefficients(words).tolist()
    rows = -(-len(data) // cf.ROW_NBYTES)
    padded = data + bytes(rows * cf.ROW_NBYTES - len(data))
    r = []
    for k in range(rows):
        row = padded[k * cf.ROW_NBYTES : (k + 1) * cf.ROW_NBYTES]
        w = [int.from_bytes(row[2 * i : 2 * i + 2], "little", signed=True) for i in range(words)]
        r.append([sum(c * x for c, x in zip(a[h], w, strict=True)) % cf.PRIME for h in range(cf.HASHES)])
    g = cf._level2_generator()
    out = [0] * cf.HASHES
    for first in range(0, rows, cf.LEVEL2_ROWS):
        n = min(cf.LEVEL2_ROWS, rows - first)
        b = cf._level2_block(g, n).tolist()
        for k in range(n):
            for h in range(cf.HASHES):
                for j in range(cf.LIMBS):
                    out[h] += b[k][h][j] * ((r[first + k][h] >> (16 * j)) & 0xFFFF)
    return [v % cf.PRIME for v in out]


def digest_values(fp) -> list[int]:
    return [int.from_bytes(fp.digest[8 * h : 8 * h + 8], "little") for h in range(cf.HASHES)]


@pytest.fixture
def small_rows(monkeypatch):
    """64-byte rows, 3 rows per step, 2 rows per second-level block: every boundary within a few hundred bytes."""
    monkeypatch.setattr(cf, "ROW_NBYTES", 64)
    monkeypatch.setattr(cf, "STEP_ROWS", 3)
    monkeypatch.setattr(cf, "LEVEL2_ROWS", 2)


def _bytes(n: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed + n)
    return bytes(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).tolist())


SMALL_LENGTHS = [0, 1, 3, 4, 5, 63, 64, 65, 127, 128, 129, 191, 192, 193, 383, 384, 385, 1000]


@pytest.mark.parametrize("n", SMALL_LENGTHS)
def test_fingerprint_is_the_formula_at_every_boundary(small_rows, n):
    data = _bytes(n)
    fp = cf._fingerprint(torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else
                         torch.empty(0, dtype=torch.uint8))
    assert fp.nbytes == n and fp.algo == cf.ALGO
    assert digest_values(fp) == reference(data)


@pytest.mark.parametrize("n", [1, 5, cf.ROW_NBYTES - 1, cf.ROW_NBYTES, cf.ROW_NBYTES + 1, 2 * cf.ROW_NBYTES + 3])
def test_fingerprint_is_the_formula_at_the_real_row_size(n):
    data = _bytes(n, seed=7)
    fp = cf._fingerprint(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert digest_values(fp) == reference(data)


def test_words_are_signed_and_extreme_values_do_not_overflow(small_rows):
    for data in (b"\xff" * 385, b"\x00\x80" * 192, b"\xff\x7f" * 192 + b"\x80"):
        fp = cf._fingerprint(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        assert digest_values(fp) == reference(data)


@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_equal_bytes_equal_fingerprints_whatever_the_storage_offset(small_rows, offset):
    data = _bytes(777, seed=3)
    base = torch.zeros(777 + 16, dtype=torch.uint8)
    base[offset : offset + 777] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    view = base[offset : offset + 777]
    assert view.storage_offset() == offset
    assert cf._fingerprint(view) == cf._fingerprint(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert digest_values(cf._fingerprint(view)) == reference(data)


def test_distinct_inputs_differ(small_rows):
    data = bytearray(_bytes(385, seed=11))
    seen = {cf._fingerprint(torch.frombuffer(bytearray(data), dtype=torch.uint8)).digest}
    for i in (0, 1, 63, 64, 191, 192, 200, 383, 384):
        for bit in (0, 7):
            other = bytearray(data)
            other[i] ^= 1 << bit
            seen.add(cf._fingerprint(torch.frombuffer(other, dtype=torch.uint8)).digest)
    swapped = bytearray(data[64:128] + data[:64] + data[128:])  # two rows exchanged
    seen.add(cf._fingerprint(torch.frombuffer(swapped, dtype=torch.uint8)).digest)
    assert len(seen) == 1 + 9 * 2 + 1
    # A trailing zero byte changes the length, which is part of the fingerprint.
    a = cf._fingerprint(torch.frombuffer(bytearray(b"ab"), dtype=torch.uint8))
    b = cf._fingerprint(torch.frombuffer(bytearray(b"ab\0"), dtype=torch.uint8))
    assert a.digest == b.digest and a != b


def test_refuses_what_is_not_a_flat_byte_tensor():
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        cf._fingerprint(torch.zeros(4, dtype=torch.int16))
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        cf._fingerprint(torch.zeros(4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        cf._fingerprint(torch.zeros(8, dtype=torch.uint8)[::2])
    with pytest.raises(ValueError, match="CUDA tensor"):
        cf.gpu_fingerprint(torch.zeros(4, dtype=torch.uint8))
