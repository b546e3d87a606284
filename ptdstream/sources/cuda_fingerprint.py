"""A content fingerprint computed where the bytes are (on the GPU for CUDA tensors), with no matrix product.

Elementwise products and sums only (no cuBLAS: no GEMM kernels loaded, no
cuBLAS workspace allocated), in two levels of linear hashing over the prime
field ``p = 2^61 - 1``, ``HASHES`` (4) independent hashes, each ``h`` with its own
coefficients, all in ``[0, 2^31)``, derived on the CPU (the same on every
device) from a 256-bit per-process key drawn from ``secrets``: each block of
coefficients is ``SHAKE-256(key || domain || index)`` read as little-endian
32-bit words with the top bit masked off (uniform output words give uniform
values on ``[0, 2^31)``), the first level and each second-level block from
distinct inputs of the extendable-output function (:func:`_coefficients`):

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
the coefficients, when the coefficients are truly uniform and independent:
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
agree with probability at most ``2^-120``. With the coefficients taken from
SHAKE-256 under the secret key, the same bound holds (up to any advantage in
telling SHAKE-256's output from uniform) for any pair of inputs chosen without
knowledge of the key: the key never leaves the process (:data:`ALGO` names it by
a separate SHAKE-256 output; nothing persists fingerprints). Inputs chosen
by someone who knows the coefficients can collide at will (the hash is linear). No arithmetic is plain mod 2^64:
every sum is exact (the bounds above) and every reduction is mod ``p``.

Fingerprints are comparable only within one process (the key is per process,
nothing persists them) and only between inputs of the same length (the length
is part of the fingerprint).
"""

from __future__ import annotations

import hashlib
import secrets
import struct
import sys
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
#: The per-process key of every coefficient (256 bits; never written anywhere).
_KEY = secrets.token_bytes(32)
#: The domains of :func:`_coefficients`: the first level's block, the second level's blocks.
_LEVEL1 = b"\x01"
_LEVEL2 = b"\x02"
_KEY_ID = b"\x03"
ALGO = f"words16-p61x4-2level-shake256:{hashlib.shake_256(_KEY + _KEY_ID).hexdigest(8)}"
_BLOCKS: dict[tuple[bytes, str, int | None, int], torch.Tensor] = {}


def _coefficients(domain: bytes, index: int, count: int) -> torch.Tensor:
    """``count`` coefficients in ``[0, 2^31)``, int64 on the CPU: the first ``4 * count``
    bytes of ``SHAKE-256(_KEY || domain || index as 8 little-endian bytes)`` as
    little-endian 32-bit words, the top bit of each masked off."""
    import torch

    stream = bytearray(hashlib.shake_256(_KEY + domain + index.to_bytes(8, "little")).digest(4 * count))
    if sys.byteorder != "little":  # torch.frombuffer reads native order
        stream[:] = b"".join(stream[i : i + 4][::-1] for i in range(0, len(stream), 4))
    words = torch.frombuffer(stream, dtype=torch.int32) if count else torch.empty(0, dtype=torch.int32)
    return (words & (_COEFFICIENT_BOUND - 1)).to(torch.int64)


def _row_coefficients(words: int) -> torch.Tensor:
    """First-level coefficients ``a``: ``(HASHES, words)`` int64 in ``[0, 2^31)`` on the CPU
    (domain ``_LEVEL1``, index ``words``; ``a[h, i]`` is value ``h * words + i``)."""
    return _coefficients(_LEVEL1, words, HASHES * words).view(HASHES, words)


def _level2_block(index: int, rows: int) -> torch.Tensor:
    """Second-level coefficients ``b`` of rows ``index * LEVEL2_ROWS`` onwards:
    ``(rows, HASHES, LIMBS)`` int64 in ``[0, 2^31)`` on the CPU (domain ``_LEVEL2``,
    index ``index``; ``b[k, h, j]`` is value ``(k * HASHES + h) * LIMBS + j``)."""
    return _coefficients(_LEVEL2, index, rows * HASHES * LIMBS).view(rows, HASHES, LIMBS)


def _block(device: torch.device, words: int) -> torch.Tensor:
    """``_row_coefficients(words)`` on ``device``, as ``(1, HASHES, words)`` (cached)."""
    key = (_KEY, device.type, device.index, words)
    found = _BLOCKS.get(key)
    if found is None:
        found = _BLOCKS[key] = _row_coefficients(words).to(device).view(1, HASHES, words)
    return found


def _fingerprint(flat: torch.Tensor) -> Fingerprint:
    """The fingerprint of a contiguous 1-D ``uint8`` tensor on any device (any
    size, 0 included; any storage offset: equal bytes, equal fingerprints).

    Memory added on the tensor's device: ``STEP_ROWS * HASHES * ROW_NBYTES * 4``
    bytes of product (4 MiB), one row of padding (128 KiB; the whole step when the
    address or the storage offset is odd), ``HASHES * 8`` bytes per row of row hashes (1/4096 of
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
    if flat.data_ptr() % 2 == 0 and flat.storage_offset() % 2 == 0:  # what .view(int16) takes
        rows_in_place = flat[: full * ROW_NBYTES].view(torch.int16).view(full, 1, words)
        for first in range(0, full, step):  # the steps' few calls are what bound the speed
            last = min(first + step, full)
            out = product if last - first == step else product[: last - first]
            torch.mul(rows_in_place[first:last], block, out=out)  # |a * w| < 2^46
            torch.sum(out, dim=2, out=row_hashes[first:last])  # exact: 2^16 terms
    else:  # an odd address or storage offset: each step is copied to an aligned buffer first
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
    acc = torch.zeros(HASHES, dtype=torch.int64, device=device)
    for first in range(0, rows, LEVEL2_ROWS):
        n = min(LEVEL2_ROWS, rows - first)
        limbs = (row_hashes[first : first + n].unsqueeze(2) >> shifts) & 0xFFFF  # (n, HASHES, LIMBS)
        terms = limbs * _level2_block(first // LEVEL2_ROWS, n).to(device)  # < 2^47
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
