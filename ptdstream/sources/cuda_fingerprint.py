"""A content fingerprint computed on the GPU, without copying the data to the host.

Two levels of universal hashing (imported lazily; needs CUDA):

1. The bytes, read in place as int8, form rows of ``ROW_NBYTES`` (4096; the tail
   row is zero-padded). An exact int8 matrix product on the tensor cores
   (``torch._int_mm``) multiplies them by a random ``ROW_NBYTES x 16`` int8 matrix
   ``A``: 16 sums per row, each exact in int32 (|sum| <= 4096 * 128 * 128 = 2^26).
2. The row sums, shifted to be non-negative, are combined by 4 linear hashes over
   the prime field ``p = 2^61 - 1`` with random coefficients in ``[0, 2^31)``,
   reduced mod p in int64 without overflow (every partial sum stays below 2^63).

Collision probability for a fixed pair of distinct inputs of equal length, over
the random choice of ``A`` and the coefficients (drawn once per process from
``secrets``): the inputs differ in some row; the 16 sums of that row all agree
with probability at most ``(1/256)^16 = 2^-128`` (for each column, fixing every
other entry of ``A``, at most one of the 256 values of the entry facing a
differing byte makes the sums agree). When some row sum differs by ``d``
(``0 < |d| < 2^27 < p``), each second-level hash agrees with probability at most
``2^-31`` (``b * d = c mod p`` has one solution mod p, at most one in a range of
2^31 < p), independently for the 4 hashes: ``2^-124``. In all: at most
``2^-128 + 2^-124 < 2^-123``. No arithmetic is plain mod 2^64.

Fingerprints are comparable only within one process (the seed is per process)
and only between inputs of the same length (the length is part of the
fingerprint).
"""

from __future__ import annotations

import secrets
import struct
from typing import TYPE_CHECKING

from ..upstream.adapter import int_mm
from .fingerprint import Fingerprint

if TYPE_CHECKING:
    import torch

__all__ = ["ROW_NBYTES", "gpu_fingerprint"]

ROW_NBYTES = 4096
COLUMNS = 16
HASHES = 4
PRIME = (1 << 61) - 1
#: Rows per matrix product: 16 Ki rows = 64 MiB of input at a time, so the
#: scratch (about 1.35 KiB per row) stays near 21 MiB whatever the input's size,
#: while the steps stay few enough for kernel launches not to dominate.
CHUNK_ROWS = 1 << 14
_MIN_ROWS = 17  # torch._int_mm needs more than 16 rows
_SEED = secrets.randbits(62)
ALGO = f"gpu-int8mm16-p61x4:{_SEED:016x}"
_CACHE: dict[tuple[int, str], tuple[torch.Tensor]] = {}


def _matrices(device: torch.device) -> torch.Tensor:
    import torch

    key = (device.index or 0, device.type)
    found = _CACHE.get(key)
    if found is None:
        g = torch.Generator(device=device)
        g.manual_seed(_SEED)
        a = torch.randint(-128, 128, (COLUMNS, ROW_NBYTES), generator=g, device=device, dtype=torch.int8)
        # Column-major B operand for _int_mm: (ROW_NBYTES, COLUMNS) with stride (1, ROW_NBYTES).
        found = (a.t(),)
        _CACHE[key] = found
    return found[0]


def _coefficients(device: torch.device, first_row: int, rows: int) -> torch.Tensor:
    """Second-level coefficients of the 4 hashes for rows [first_row, first_row + rows).

    Shape ``(HASHES, rows * COLUMNS)``, uniform in ``[0, 2^31)``, drawn per chunk
    from a generator seeded by the process seed and the chunk's first row, so
    the same row position always gets the same coefficients.
    """
    import torch

    g = torch.Generator(device=device)
    g.manual_seed((_SEED * 1_000_003 + first_row) % (1 << 63))
    return torch.randint(0, 1 << 31, (HASHES, rows * COLUMNS), generator=g, device=device, dtype=torch.int64)


def _sum_mod_p(v: torch.Tensor) -> torch.Tensor:
    """Row sums mod p of a 2-D int64 tensor of values in [0, p), without
    overflow (groups of 3 stay below 2^63)."""
    import torch

    while v.shape[1] > 1:
        pad = (-v.shape[1]) % 3
        if pad:
            v = torch.cat([v, v.new_zeros(v.shape[0], pad)], dim=1)
        v = v.view(v.shape[0], -1, 3).sum(2) % PRIME
    return v[:, 0]


def gpu_fingerprint(flat: torch.Tensor) -> Fingerprint:
    """Fingerprint a contiguous CUDA ``uint8`` tensor (any size, 0 included).

    Reads the data once on the device; host traffic is 32 bytes. Memory added on
    the device: about ``1.35 KiB * min(CHUNK_ROWS, rows)`` (21 MiB at most, for
    inputs of 64 MiB or more; proportionally less for smaller ones).

    Raises:
        ValueError: the tensor is not a contiguous 1-D uint8 CUDA tensor.
    """
    import torch

    if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous() or flat.device.type != "cuda":
        raise ValueError("gpu_fingerprint takes a contiguous 1-D uint8 CUDA tensor")
    nbytes = flat.numel()
    device = flat.device
    b_matrix = _matrices(device)
    full = nbytes // ROW_NBYTES
    acc = torch.zeros(HASHES, dtype=torch.int64, device=device)
    data = flat.view(torch.int8)
    row = 0
    while row < full or (row == full and nbytes % ROW_NBYTES):
        if row < full:
            rows = min(CHUNK_ROWS, full - row)
            block = data[row * ROW_NBYTES : (row + rows) * ROW_NBYTES].view(rows, ROW_NBYTES)
        else:
            rows = 1
            block = torch.zeros(1, ROW_NBYTES, dtype=torch.int8, device=device)
            tail = data[full * ROW_NBYTES :]
            block[0, : tail.numel()] = tail
        if rows < _MIN_ROWS:
            padded = torch.zeros(_MIN_ROWS, ROW_NBYTES, dtype=torch.int8, device=device)
            padded[:rows] = block
            sums = int_mm(padded, b_matrix)[:rows]
        else:
            sums = int_mm(block, b_matrix)
        shifted = sums.to(torch.int64).view(1, -1) + (1 << 26)  # [0, 2^27]
        products = _coefficients(device, row, rows) * shifted  # < 2^58
        pad = (-products.shape[1]) % 32
        if pad:
            products = torch.cat([products, products.new_zeros(HASHES, pad)], dim=1)
        # 32 products < 32 * 2^58 = 2^63: no overflow before the reduction mod p.
        partial = products.view(HASHES, -1, 32).sum(2) % PRIME
        acc = (acc + _sum_mod_p(partial)) % PRIME
        row += rows
    digest = b"".join(struct.pack("<Q", int(v)) for v in acc.tolist())
    return Fingerprint(nbytes, ALGO, digest)
