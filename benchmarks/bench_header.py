#!/usr/bin/env python
"""What a safetensors header full of zero-size keys costs before any byte is read.

A valid header may name any number of tensors of no bytes (``{"dtype": "F32",
"shape": [0], "data_offsets": [0, 0]}``); at safetensors' own 100 MB header limit
that is about 1.5 million keys beside the two real tensors of the file. Each case
writes such a file (the two tensors of 16 bytes each, then ``--keys`` empty ones)
and opens it as ptdstream does before an export (``open_checkpoint``, closed at
once), in a fresh process per tree and size: torch and safetensors are imported
first and not counted (and executorch's ``exir.tensor``, which an older reader
imported on its first key); the row gives the CPU seconds (``time.process_time``) and
the resident memory added (``VmHWM`` minus ``VmRSS`` before, so the peak counts)
by the open, and both per key.

Usage:
    python benchmarks/bench_header.py                                  # this tree
    python benchmarks/bench_header.py --base /work/main --keys 10000 100000 200000

With ``--base TREE`` each size also runs with another checkout's package
(``PYTHONPATH=TREE``, the same interpreter), side by side. Files go to a
temporary folder, removed at the end (about 70 bytes of header a key).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Run in the child: open the checkpoint, print CPU seconds and KiB added.
CHILD = r"""
import sys, time
import torch, safetensors.torch  # imported first: not counted
import executorch.exir.tensor  # (main's reader imported it on the first key)
from ptdstream.sources.checkpoint import open_checkpoint

def kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = kib("VmRSS")
cpu = time.process_time()
with open_checkpoint(sys.argv[1]) as ckpt:
    n = len(ckpt.entries)
cpu = time.process_time() - cpu
print(n, cpu, kib("VmHWM") - before)
"""


def write_file(path: str, nkeys: int) -> None:
    """A valid safetensors file: ``a`` and ``b`` (4 float32 each), then ``nkeys`` empty tensors."""
    header: dict[str, object] = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]},
    }
    for i in range(nkeys):
        header[f"empty.{i}"] = {"dtype": "F32", "shape": [0], "data_offsets": [32, 32]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + bytes(32))


def measure(tree: str, path: str) -> tuple[int, float, int]:
    """(keys, CPU seconds, KiB added) of opening ``path`` with ``tree``'s package."""
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", CHILD, path], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(path))  # not this folder: -c puts the working folder first on sys.path
    if out.returncode:
        raise SystemExit(f"{tree}: {path}: exit {out.returncode}\n{out.stderr[-2000:]}")
    n, cpu, kib = out.stdout.split()
    return int(n), float(cpu), int(kib)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[10_000, 100_000, 200_000])
    parser.add_argument("--base", help="another checkout to compare with (its package on PYTHONPATH)")
    args = parser.parse_args()
    trees = [("this", ROOT)] + ([("base", os.path.abspath(args.base))] if args.base else [])
    scratch = tempfile.mkdtemp(prefix="bench-header-")
    try:
        head = "| keys | header MB |" + "".join(
            f" {name} CPU s | {name} RSS MiB | {name} us/key | {name} B/key |" for name, _ in trees)
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        for nkeys in args.keys:
            path = os.path.join(scratch, f"empty-{nkeys}.safetensors")
            write_file(path, nkeys)
            row = f"| {nkeys:,} | {os.path.getsize(path) / 1e6:.1f} |"
            for _name, tree in trees:
                n, cpu, kib = measure(tree, path)
                if n != nkeys + 2:
                    raise SystemExit(f"{tree}: {n} entries, expected {nkeys + 2}")
                row += f" {cpu:.2f} | {kib / 1024:.1f} | {cpu / n * 1e6:.1f} | {kib * 1024 // n} |"
            print(row, flush=True)
            os.unlink(path)
    finally:
        shutil.rmtree(scratch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
