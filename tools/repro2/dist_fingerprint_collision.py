"""Claim 6 ("the output equals ptdstream.write_data_files of a store that received
the whole tensors"; dedup by content): two different tensors crafted to share
their size, first 32 bytes and the distributed fingerprint.

The distributed fingerprint (ptdstream/distributed/fingerprint.py) is linear:
H_j(x) = sum x[i] r_j**i mod 2**61-1 at three fixed public points. A difference
vector d with small entries (|d_i| <= 255) and sum d_i r_j**i == 0 mod p for the
three points is a short vector of a lattice: LLL (python-flint's) finds one in a second.
x and y = x + d then collide. The one-process store digests candidates with
xxh3-128 and keeps both; the distributed writer (every rank's composable digest,
compared by PlannedSource.same_content, plan.py:58-61) dedups y into x: y's key
gets x's bytes in the .ptd, silently, and no later check compares them (each rank
checks only the pieces it writes against its own hand-over digest).

The module docstring says "with the three points fixed and inputs not chosen
against them": this is the chosen-input case, so a known limit, but the result is
silent wrong data for a key, not a refusal.

Expected: the one-process bytes (x and y stored separately), or a refusal.
Actual: printed (the run uses a 1-rank gloo group: the planner is the same).

usage: pip install --target /tmp/flint python-flint
       PYTHONPATH=.:/tmp/flint python tools/repro2/dist_fingerprint_collision.py   (about 15 s)
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from datetime import timedelta


def _lll(rows):
    """LLL of the rows (python-flint: ``pip install --target DIR python-flint``, DIR on PYTHONPATH)."""
    import flint

    m = flint.fmpz_mat(rows).lll()
    return [[int(m[i, j]) for j in range(m.ncols())] for i in range(m.nrows())]


def short_difference(n: int = 48):
    """A vector d (|d_i| <= 127) with sum d_i r_j**(32 + i) == 0 mod p for every point r_j."""
    from ptdstream.distributed.fingerprint import P, POINTS

    offset = 32  # the difference starts past the first 32 bytes
    big = 1 << 40
    rows = []
    for i in range(n):
        row = [0] * n
        row[i] = 1
        row += [big * pow(r, offset + i, P) for r in POINTS]
        rows.append(row)
    for j in range(3):
        row = [0] * (n + 3)
        row[n + j] = big * P
        rows.append(row)
    for row in _lll(rows):
        d, tail = row[:n], row[n:]
        if all(v == 0 for v in tail) and any(d) and max(abs(v) for v in d) <= 127:
            return offset, [int(v) for v in d]
    raise SystemExit("no short vector found")


def main() -> int:
    import torch
    import torch.distributed as dist

    from ptdstream.distributed import write_data_files as dist_write
    from ptdstream.distributed.fingerprint import combine, digest_piece
    from ptdstream.save import write_data_files
    from ptdstream.store import StreamingNamedDataStore

    offset, d = short_difference()
    size = offset + len(d)
    x = bytearray([128] * size)
    y = bytearray(x)
    for i, v in enumerate(d):
        y[offset + i] += v
    assert x != y and x[:32] == y[:32]
    fx = combine(size, [digest_piece([bytes(x)], 0)])
    fy = combine(size, [digest_piece([bytes(y)], 0)])
    print(f"x != y, same size {size} and first 32 bytes; same distributed fingerprint: {fx == fy}")
    tx = torch.frombuffer(bytearray(x), dtype=torch.uint8).clone()
    ty = torch.frombuffer(bytearray(y), dtype=torch.uint8).clone()
    root = tempfile.mkdtemp(prefix="b2fp-")
    try:
        store = StreamingNamedDataStore()
        store.add_named_data("x", tx, alignment=1, external_tag="model")
        store.add_named_data("y", ty, alignment=1, external_tag="model")
        os.makedirs(os.path.join(root, "one"))
        write_data_files(store, os.path.join(root, "one"))
        dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1,
                                timeout=timedelta(seconds=30))
        try:
            os.makedirs(os.path.join(root, "dist"))
            report = dist_write({"x": tx, "y": ty}, os.path.join(root, "dist"), external_tag="model")
        finally:
            dist.destroy_process_group()
        one = open(os.path.join(root, "one", "model.ptd"), "rb").read()
        got = open(os.path.join(root, "dist", "model.ptd"), "rb").read()
        print(f"one process: {len(one)} bytes; distributed: {len(got)} bytes, dedup saved "
              f"{report.dedup_saved_nbytes} bytes; y's bytes present in the distributed .ptd: {bytes(y) in got}")
        print("expected: the one-process .ptd (x and y both stored)")
        print(f"actual: {'equal' if got == one else 'DIFFERS: y deduplicated into x (y reads as x)'}")
        return 0 if got == one else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
