"""A content fingerprint computed where the bytes are (on the GPU for CUDA tensors), with no matrix product.

Elementwise products and sums only (no cuBLAS: no GEMM kernels loaded, no
cuBLAS workspace allocated), in two levels of linear hashing over the prime
field ``p = 2^61 - 1``, ``HASHES`` (4) independent hashes, each ``h`` with its own
coefficients, all drawn uniformly from ``[0, 2^31)`` by CPU generators seeded
from a per-process seed (``secrets``), the same on every device:

1. The bytes, zero-padded to whole rows of ``ROW_NBYTES`` (128 KiB), are read
   in place as little-endian signed 16-bit words ``w[k, i]`` (row ``k``, word
   ``i < L = ROW_NBYTES / 2``). Each row's hash is
   ``r[h, k] = (sum_i a[h, i] * w[k, i]) mod p`` with one coefficient block
   ``a[h, :]`` reused by every row. The sum is exact in int64: each term is below
   ``2^31 * 2^15 = 2^46`` in magnitude and there are ``2^16`` of them.
2. Each ``r[h, k] < 2^61`` is split into four 16-bit limbs ``u[h, k, j]``
   (``r = sum_j u[h, k, j] * 2^(16 j)``) and
   ``F[h] = (sum_{k, j} b[h, k, j] * u[h, k, j]) mod p`` with a coefficient per
   position ``b[h, k, j]``, drawn in blocks of ``LEVEL2_ROWS`` rows (each block's
   sum exact: ``LEVEL2_ROWS * 4 <= 2^16`` terms, each below ``2^47``).

The fingerprint is the length in bytes and ``F[0..3]``. Collision probability
for a fixed pair of distinct inputs of equal length, over the random choice of
the coefficients (the generators' outputs taken as uniform and independent):
the inputs differ in a word ``w[k, i]`` of some row ``k``, by ``d`` with
``0 < |d| < 2^16 < p``, so ``d`` is invertible mod ``p``. For one hash, fixing
every coefficient but ``a[h, i]``, the two ``r[h, k]`` agree for exactly one
residue of ``a[h, i]`` mod ``p``; ``a[h, i]`` is uniform on ``[0, 2^31)``, which
holds at most one number of each residue (``2^31 < p``): probability at most
``2^-31``. When some ``r[h, k]`` differ, their limbs (a one-to-one split of
numbers below ``2^64``) differ in some position by ``d'`` with
``0 < |d'| < 2^16``, and the same argument on that position's ``b`` (drawn
independently of ``a``) bounds the probability that the ``F[h]`` agree by
``2^-31``. So one hash agrees with probability at most
``2^-31 + 2^-31 = 2^-30``; the 4 hashes draw independent coefficients, so all 4
agree with probability at most ``2^-120``. No arithmetic is plain mod 2^64:
every sum is exact (the bounds above) and every reduction is mod ``p``.

Fingerprints are comparable only within one process (the seed is per process,
nothing persists them) and only between inputs of the same length (the length
is part of the fingerprint).
"""

from __future__ import annotations

import secrets
import struct
from typing import TYPE_CHECKING

from .fingerprint import Fingerprint

if TYPE_CHECKING:
    import torch

__all__ = ["ROW_NBYTES", "STEP_ROWS", "gpu_fingerprint"]

#: Bytes per row of the first level: 2^16 16-bit words.
ROW_NBYTES = 1 << 17
#: Rows per step (one product and one sum each): the product's scratch is
#: ``STEP_ROWS * HASHES * ROW_NBYTES * 4`` bytes (4 MiB), the coefficient block
#: ``HASHES * ROW_NBYTES * 4`` (2 MiB, kept per device).
STEP_ROWS = 2
#: Rows per block of second-level coefficients (at most 2^14: exact sums); its
#: temporaries take ``LEVEL2_ROWS * 512`` bytes (2 MiB).
LEVEL2_ROWS = 1 << 12
HASHES = 4
LIMBS = 4
PRIME = (1 << 61) - 1
_COEFFICIENT_BOUND = 1 << 31
_SEED = secrets.randbits(62)
ALGO = f"words16-p61x4-2level:{_SEED:016x}"
_BLOCKS: dict[tuple[str, int | None, int], torch.Tensor] = {}


def _row_coefficients(words: int) -> torch.Tensor:
    """First-level coefficients ``a``: ``(HASHES, words)`` int64 in ``[0, 2^31)`` on the CPU."""
    import torch

    g = torch.Generator()
    g.manual_seed(_SEED)
    return torch.randint(0, _COEFFICIENT_BOUND, (HASHES, words), generator=g, dtype=torch.int64)


def _level2_generator() -> torch.Generator:
    """The CPU generator of the second-level coefficients ``b``, drawn in blocks of
    ``(rows, HASHES, LIMBS)`` (:func:`_level2_block`), in order, from row 0."""
    import torch

    g = torch.Generator()
    g.manual_seed((_SEED * 1_000_003 + 1) % (1 << 63))
    return g


def _level2_block(g: torch.Generator, rows: int) -> torch.Tensor:
    import torch

    return torch.randint(0, _COEFFICIENT_BOUND, (rows, HASHES, LIMBS), generator=g, dtype=torch.int64)


def _block(device: torch.device, words: int) -> torch.Tensor:
    """``_row_coefficients(words)`` on ``device``, as ``(1, HASHES, words)`` (cached)."""
    key = (device.type, device.index, words)
    found = _BLOCKS.get(key)
    if found is None:
        found = _BLOCKS[key] = _row_coefficients(words).to(device).view(1, HASHES, words)
    return found


def _fingerprint(flat: torch.Tensor) -> Fingerprint:
    """The fingerprint of a contiguous 1-D ``uint8`` tensor on any device (any
    size, 0 included; any storage offset: equal bytes, equal fingerprints).

    Memory added on the tensor's device: ``STEP_ROWS * HASHES * ROW_NBYTES * 4``
    bytes of product (4 MiB), one row of padding (128 KiB; the whole step when the
    address is odd), ``HASHES * 8`` bytes per row of row hashes (1/4096 of
    the input) and, after the first level's scratch is freed, the second level's
    ``min(rows, LEVEL2_ROWS) * 512`` bytes (2 MiB at most); plus the coefficient
    block, 2 MiB kept per device. Reads the bytes once;
    host traffic: the second-level coefficients (``rows * 128`` bytes) and 32 bytes back.

    Raises:
        ValueError: the tensor is not a contiguous 1-D uint8 tensor.
    """
    import torch

    if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("the fingerprint takes a contiguous 1-D uint8 tensor")
    nbytes = flat.numel()
    device = flat.device
    words = ROW_NBYTES // 2
    rows = -(-nbytes // ROW_NBYTES)
    full = nbytes // ROW_NBYTES
    block = _block(device, words)
    row_hashes = torch.empty(rows, HASHES, dtype=torch.int64, device=device)
    step = min(STEP_ROWS, max(rows, 1))
    product = torch.empty(step, HASHES, words, dtype=torch.int64, device=device)
    if flat.data_ptr() % 2 == 0:
        rows_in_place = flat[: full * ROW_NBYTES].view(torch.int16).view(full, 1, words)
        for first in range(0, full, step):  # the steps' few calls are what bound the speed
            last = min(first + step, full)
            out = product if last - first == step else product[: last - first]
            torch.mul(rows_in_place[first:last], block, out=out)  # |a * w| < 2^46
            torch.sum(out, dim=2, out=row_hashes[first:last])  # exact: 2^16 terms
    else:  # an odd address: each step is copied to an aligned buffer first
        staging = torch.empty(step * ROW_NBYTES, dtype=torch.uint8, device=device)
        for first in range(0, full, step):
            n = min(step, full - first)
            piece = staging[: n * ROW_NBYTES].copy_(flat[first * ROW_NBYTES : (first + n) * ROW_NBYTES])
            torch.mul(piece.view(torch.int16).view(n, 1, words), block, out=product[:n])
            torch.sum(product[:n], dim=2, out=row_hashes[first : first + n])
        del staging
    if full < rows:  # the tail row, zero-padded
        pad = torch.zeros(ROW_NBYTES, dtype=torch.uint8, device=device)
        pad[: nbytes - full * ROW_NBYTES] = flat[full * ROW_NBYTES :]
        torch.mul(pad.view(torch.int16).view(1, 1, words), block, out=product[:1])
        torch.sum(product[:1], dim=2, out=row_hashes[full:])
        del pad
    del product
    row_hashes.remainder_(PRIME)  # [0, p)
    shifts = torch.arange(0, 16 * LIMBS, 16, dtype=torch.int64, device=device)
    g = _level2_generator()
    acc = torch.zeros(HASHES, dtype=torch.int64, device=device)
    for first in range(0, rows, LEVEL2_ROWS):
        n = min(LEVEL2_ROWS, rows - first)
        limbs = (row_hashes[first : first + n].unsqueeze(2) >> shifts) & 0xFFFF  # (n, HASHES, LIMBS)
        terms = limbs * _level2_block(g, n).to(device)  # < 2^47
        acc = (acc + terms.sum(dim=(0, 2)) % PRIME) % PRIME  # exact: n * 4 <= 2^16 terms
    digest = b"".join(struct.pack("<Q", int(v)) for v in acc.tolist())
    return Fingerprint(nbytes, ALGO, digest)


def gpu_fingerprint(flat: torch.Tensor) -> Fingerprint:
    """Fingerprint a contiguous 1-D CUDA ``uint8`` tensor (any size, 0 included), on its device.

    As :func:`_fingerprint` (memory, traffic), restricted to CUDA tensors.

    Raises:
        ValueError: the tensor is not a contiguous 1-D uint8 CUDA tensor.
    """
    if flat.device.type != "cuda":
        raise ValueError("gpu_fingerprint takes a contiguous 1-D uint8 CUDA tensor")
    return _fingerprint(flat)
