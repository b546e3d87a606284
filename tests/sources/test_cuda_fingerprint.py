"""The device fingerprint's formula, checked on CPU tensors against a big-integer reference."""

from __future__ import annotations

import hashlib

import pytest
import torch

from ptdstream.sources import cuda_fingerprint as cf


def shake_coefficients(domain: int, index: int, count: int) -> list[int]:
    """The module docstring's derivation in Python integers: SHAKE-256 of the key, the
    domain byte and the index (8 bytes, little-endian), as little-endian 32-bit words
    with the top bit masked off."""
    stream = hashlib.shake_256(cf._KEY + bytes([domain]) + index.to_bytes(8, "little")).digest(4 * count)
    return [int.from_bytes(stream[4 * i : 4 * i + 4], "little") & 0x7FFFFFFF for i in range(count)]


def reference(data: bytes) -> list[int]:
    """The module docstring's formula in Python integers, coefficients derived from the key."""
    words = cf.ROW_NBYTES // 2
    flat_a = shake_coefficients(1, words, cf.HASHES * words)
    a = [flat_a[h * words : (h + 1) * words] for h in range(cf.HASHES)]
    rows = -(-len(data) // cf.ROW_NBYTES)
    padded = data + bytes(rows * cf.ROW_NBYTES - len(data))
    r = []
    for k in range(rows):
        row = padded[k * cf.ROW_NBYTES : (k + 1) * cf.ROW_NBYTES]
        w = [int.from_bytes(row[2 * i : 2 * i + 2], "little", signed=True) for i in range(words)]
        r.append([sum(c * x for c, x in zip(a[h], w, strict=True)) % cf.PRIME for h in range(cf.HASHES)])
    out = [0] * cf.HASHES
    for first in range(0, rows, cf.LEVEL2_ROWS):
        n = min(cf.LEVEL2_ROWS, rows - first)
        b = shake_coefficients(2, first // cf.LEVEL2_ROWS, n * cf.HASHES * cf.LIMBS)
        for k in range(n):
            for h in range(cf.HASHES):
                for j in range(cf.LIMBS):
                    out[h] += b[(k * cf.HASHES + h) * cf.LIMBS + j] * ((r[first + k][h] >> (16 * j)) & 0xFFFF)
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


def test_the_key_is_256_bits_and_its_high_bits_change_every_coefficient_block(monkeypatch):
    """Two keys equal but in their last byte (far above 32 bits) draw different first-level
    and second-level coefficients; the levels and the second level's blocks are distinct."""
    assert isinstance(cf._KEY, bytes) and len(cf._KEY) == 32
    assert cf._KEY.hex() not in cf.ALGO and cf.ALGO.startswith("words16-p61x4-2level-shake256:")
    words = cf.ROW_NBYTES // 2
    key = bytes(range(32))
    drawn = []
    for last in (31, 31 ^ 0x80):
        monkeypatch.setattr(cf, "_KEY", key[:31] + bytes([last]))
        a = cf._row_coefficients(words)
        b0, b1 = cf._level2_block(0, cf.LEVEL2_ROWS), cf._level2_block(1, cf.LEVEL2_ROWS)
        assert a.shape == (cf.HASHES, words) and b0.shape == (cf.LEVEL2_ROWS, cf.HASHES, cf.LIMBS)
        assert a.dtype == b0.dtype == torch.int64
        assert 0 <= int(a.min()) and int(a.max()) < 1 << 31 and 0 <= int(b0.min()) and int(b0.max()) < 1 << 31
        assert a.flatten()[:64].tolist() == shake_coefficients(1, words, 64)
        assert b1.flatten()[:64].tolist() == shake_coefficients(2, 1, 64)
        assert not torch.equal(b0, b1) and not torch.equal(a.flatten()[:64], b0.flatten()[:64])
        assert torch.equal(cf._level2_block(1, 3), b1[:3])  # a block's short tail is its prefix
        drawn.append((a, b0))
    assert not torch.equal(drawn[0][0], drawn[1][0]) and not torch.equal(drawn[0][1], drawn[1][1])


def test_a_new_key_changes_the_fingerprint_and_is_not_served_stale_coefficients(monkeypatch, small_rows):
    data = _bytes(385, seed=5)
    monkeypatch.setattr(cf, "_KEY", b"\x11" * 32)
    first = cf._fingerprint(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert digest_values(first) == reference(data)
    monkeypatch.setattr(cf, "_KEY", b"\x11" * 31 + b"\x12")
    second = cf._fingerprint(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert digest_values(second) == reference(data) and second.digest != first.digest


@pytest.mark.parametrize("base_parity", [0, 1])
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_any_base_address_and_storage_offset_parity(small_rows, base_parity, offset):
    """A storage whose base is at an odd address viewed at an odd offset (an even data_ptr)
    takes the staging path: ``.view(int16)`` needs an even storage offset too."""
    data = _bytes(777, seed=13)
    raw = bytearray(1024)
    start = (torch.frombuffer(raw, dtype=torch.uint8).data_ptr() + base_parity) % 2
    storage = torch.frombuffer(memoryview(raw)[start:], dtype=torch.uint8)
    assert storage.data_ptr() % 2 == base_parity
    storage[offset : offset + 777] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    view = storage[offset : offset + 777]
    assert view.storage_offset() == offset and view.data_ptr() % 2 == (base_parity + offset) % 2
    fp = cf._fingerprint(view)
    assert digest_values(fp) == reference(data) and fp == cf._fingerprint(view.clone())
