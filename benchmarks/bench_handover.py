#!/usr/bin/env python
"""What the hand-over fingerprint of mutable sources costs (issue 11, item 7).

A ``StreamingNamedDataStore`` of CPU tensors is handed to ``write_data_files``:
each tensor is fingerprinted (xxh3-128, one pass over RAM) when it is added, and
each piece is hashed again after it is written, so a tensor changed during the
save is refused instead of torn. ``save(manager)`` itself gets ``bytes`` from the
emitter (immutable: no hand-over pass), so ``bench_save`` does not see this cost.

Methods, each in a forked child, interleaved (order rotates), medians:

  ptdstream        add the tensors to a store (hand-over fingerprints), write_data_files
  ptdstream-noseal the same with the hand-over fingerprint switched off (the cost's baseline)
  raw              the same bytes written to one file in 8 MiB pieces, then fsync

Usage:
    python benchmarks/bench_handover.py                    # 0.5 GiB, 3 repeats
    python benchmarks/bench_handover.py --size-gib 2 --repeats 5 --out /data/scratch

Exit status: 0 the target passed (ptdstream >= 0.95x raw), 1 it failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import PIECE_NBYTES, MiB, discard_file, files_under, median, run_forked, write_all

METHODS = ("ptdstream", "ptdstream-noseal", "raw")
MIN_RATIO_VS_RAW = 0.95


def run(method: str, folder: str, tensors) -> dict:
    import importlib

    from ptdstream import StreamingNamedDataStore  # imported by the parent before the fork
    from ptdstream.save import write_data_files

    if method == "ptdstream-noseal":
        importlib.import_module("ptdstream.store").seal = lambda source: source
    start = time.perf_counter()
    if method == "raw":
        fd = os.open(os.path.join(folder, "raw.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in tensors:
                view = memoryview(t.numpy()).cast("B")
                for offset in range(0, len(view), PIECE_NBYTES):
                    write_all(fd, view[offset : offset + PIECE_NBYTES])
            os.fsync(fd)
        finally:
            os.close(fd)
        return {"seconds": time.perf_counter() - start, "handover_seconds": 0.0}
    store = StreamingNamedDataStore()
    for i, t in enumerate(tensors):
        store.add_named_data(f"layers.{i}.weight", t, external_tag="w")
    handover = time.perf_counter() - start
    write_data_files(store, folder)
    return {"seconds": time.perf_counter() - start, "handover_seconds": handover}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="scratch folder (default: a new temp folder)")
    args = parser.parse_args()
    import torch

    from ptdstream import StreamingNamedDataStore

    # Import everything a tensor hand-over imports (executorch's layouts: ~10 s
    # on a loaded machine) once, before the children fork.
    StreamingNamedDataStore().add_named_data("warm-up", torch.ones(4), external_tag="w")

    tensor_nbytes = 16 * MiB
    count = max(1, round(args.size_gib * (1 << 30) / tensor_nbytes))
    torch.manual_seed(0)
    tensors = [torch.randn(tensor_nbytes // 4) for _ in range(count)]
    nbytes = count * tensor_nbytes
    scratch = tempfile.mkdtemp(prefix="bench_handover-", dir=args.out)
    runs = {m: [] for m in METHODS}
    try:
        for rep in range(args.repeats):
            for method in METHODS[rep % 3:] + METHODS[: rep % 3]:
                folder = os.path.join(scratch, f"{method}-{rep}")
                os.makedirs(folder)
                result = run_forked(run, method, folder, tensors)
                for path in files_under(folder):
                    discard_file(path)
                shutil.rmtree(folder)
                runs[method].append(result)
                print(f"  {method:<17} run {rep + 1}/{args.repeats}: {result['seconds']:.3f} s "
                      f"(hand-over {result['handover_seconds']:.3f} s)", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    raw = median(r["seconds"] for r in runs["raw"])
    print(f"{'method':<17} {'seconds':>8} {'GB/s':>7} {'x raw':>6} {'hand-over s':>12}")
    for method in METHODS:
        secs = median(r["seconds"] for r in runs[method])
        hand = median(r["handover_seconds"] for r in runs[method])
        print(f"{method:<17} {secs:8.3f} {nbytes / secs / 1e9:7.3f} {raw / secs:6.3f} {hand:12.3f}")
    ratio = raw / median(r["seconds"] for r in runs["ptdstream"])
    ok = ratio >= MIN_RATIO_VS_RAW
    print(f"{count} CPU tensors, {nbytes:,} bytes; medians of {args.repeats}.\n"
          f"Target: ptdstream >= {MIN_RATIO_VS_RAW}x raw: {'PASS' if ok else 'FAIL'} ({ratio:.3f}x)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
