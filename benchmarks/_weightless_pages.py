"""The weightless route's two reads of a checkpoint, alone: the export's hash, then the save's read.

    python benchmarks/_weightless_pages.py CHECKPOINT   # a .safetensors file or a folder holding one

Every tensor of the checkpoint (``safetensors.torch.load_file``: mapped) is
wrapped as the emitter and XNNPACK wrap a weight
(:func:`ptdstream.hooks.emitter.reference`); its pages are dropped first (cold
start); then every reference's SHA-256 (what naming the weights costs while
exporting) and a second read of every one in 8 MiB pieces (what the save
reads). Prints each pass's seconds, the checkpoint's bytes left in the page
cache after it, and the process's ``RssFile``/``RssAnon``. No disk write: the
save's own writes and fsync are left out.
"""

from __future__ import annotations

import glob
import os
import sys
import time

MiB = 1 << 20


def _rss() -> str:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return ", ".join(f"{k} {int(fields[k].split()[0]) // 1024} MiB" for k in ("RssFile", "RssAnon"))


def main() -> int:
    from safetensors.torch import load_file

    from ptdstream.hooks.emitter import reference
    from ptdstream.sources.base import BufferRing
    from ptdstream.system.pagecache import drop_pages, resident_nbytes

    path = sys.argv[1]
    if os.path.isdir(path):
        path = sorted(glob.glob(os.path.join(path, "**", "*.safetensors"), recursive=True))[0]
    fd = os.open(path, os.O_RDONLY)
    drop_pages(fd, 0, 0)
    os.close(fd)
    refs = [reference(t.untyped_storage(), k) for k, t in load_file(path).items()]
    print(f"{path}: {sum(len(r) for r in refs) / MiB:,.0f} MiB in {len(refs)} tensors")
    t = time.perf_counter()
    for r in refs:
        r.sha256()
    seconds = time.perf_counter() - t
    print(f"hash (export): {seconds:6.2f} s, cached after {resident_nbytes(path) / MiB:,.0f} MiB, {_rss()}")
    ring = BufferRing(8 * MiB, count=3)
    t = time.perf_counter()
    for r in refs:
        for _ in r.source.pieces(ring):
            pass
    seconds = time.perf_counter() - t
    print(f"read (save):   {seconds:6.2f} s, cached after {resident_nbytes(path) / MiB:,.0f} MiB, {_rss()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
