"""CUDA weights -> .ptd: ptdstream vs pinned copy alone vs raw write vs the upstream-style path.

Run on a GPU machine (one table, side by side, one run):

    python benchmarks/bench_cuda.py --sizes-gib 8 32 --out /tmp/bench-cuda

Per size: bf16 weights on the GPU as 1 GiB storages (``layers.i.weight``).
Rows: ptdstream (CudaTensorSource through the pinned ring + writer thread, fsync,
atomic rename), buffered and with O_DIRECT; pinned device-to-host copy alone (8 MiB pieces, no file); raw
write + fsync of the same byte count from a reused host buffer; upstream-style
(8 MiB pageable ``.cpu()`` chunks + SHA-256 + write + fsync). Then: the GPU
fingerprint's speed, a second method re-adding every storage (same storages,
new tensor objects) and a third adding equal copies in new storages, as a share
of the first write; host RSS added by the ptdstream save.

``--sweep WINDOW_MIB:INFLIGHT ...`` adds buffered ptdstream saves of the same
store with other page-cache windows (``window_nbytes``) and writeback depths
(``ptdstream.system.writeback.DEFAULT_INFLIGHT_WINDOWS``), each with its per-stage
timeline, to find where a buffered save loses to the raw write.

``--alternate N`` then writes the same bytes N more times each way (raw write +
fsync, ptdstream buffered, ptdstream O_DIRECT), the order rotated every round so
that no mode always follows another or meets the disk idle first; the table
gives each round and the medians. This is the run that chooses the default
write mode for every source (buffered, since this run; ``direct=True`` for O_DIRECT).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import raw_write_fsync, timeline_lines


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    def __enter__(self):
        self.base = rss()
        self.peak = self.base
        self._done = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        return self

    def _loop(self):
        while not self._done.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._done.set()
        self._t.join()
        self.added = max(self.peak, rss()) - self.base


def alternate(store, out: str, piece: int, nbytes: int, rounds: int) -> list:
    """``rounds`` x (raw, buffered, O_DIRECT) writes of ``nbytes``, the order rotated each round."""
    from ptdstream.save import write_data_files

    buf = memoryview(bytearray(64 << 20))
    ptd = os.path.join(out, "aoti_cuda_blob.ptd")
    modes = ["raw", "buffered", "direct"]
    results = []
    for r in range(rounds):
        order = modes[r % 3:] + modes[:r % 3]
        row = {"order": order}
        for mode in order:
            if mode == "raw":
                path = os.path.join(out, "raw.bin")
                row["raw"] = raw_write_fsync(path, nbytes, buf)
            else:
                path = ptd
                t = time.perf_counter()
                write_data_files(store, out, chunk_nbytes=piece, direct=mode == "direct")
                row[mode] = time.perf_counter() - t
            os.remove(path)
            os.sync()
        results.append(row)
    return results


def run(size_gib: int, out: str, piece: int, sweep=(), upstream_style: bool = True, rounds: int = 0) -> dict:
    import torch

    from ptdstream import StreamingNamedDataStore
    from ptdstream.save import write_data_files
    from ptdstream.sources.cuda_fingerprint import gpu_fingerprint

    nbytes = size_gib << 30
    weights = {f"layers.{i}.weight": torch.empty(1 << 14, 1 << 15, dtype=torch.bfloat16, device="cuda").normal_()
               for i in range(size_gib)}
    torch.cuda.synchronize()
    res = {"gib": size_gib, "bytes": nbytes}
    os.makedirs(out, exist_ok=True)

    # GPU fingerprint.
    flat = next(iter(weights.values())).view(-1).view(torch.uint8)
    gpu_fingerprint(flat)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for w in weights.values():
        gpu_fingerprint(w.view(-1).view(torch.uint8))
    torch.cuda.synchronize()
    res["fingerprint_s"] = time.perf_counter() - t

    # Pinned copy alone.
    ring = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    t = time.perf_counter()
    k = 0
    with torch.cuda.stream(stream):
        for w in weights.values():
            f8 = w.view(-1).view(torch.uint8)
            for i in range(0, f8.numel(), piece):
                ring[k % 4][: min(piece, f8.numel() - i)].copy_(f8[i : i + piece], non_blocking=True)
                k += 1
    stream.synchronize()
    res["pinned_copy_s"] = time.perf_counter() - t

    # ptdstream: first method writes; later methods re-add.
    store = StreamingNamedDataStore()
    for key, w in weights.items():
        store.add_named_data(key, w, alignment=16, external_tag="aoti_cuda_blob")
    with Peak() as peak:
        t = time.perf_counter()
        write_data_files(store, out, chunk_nbytes=piece, direct=False)
        res["ptdstream_s"] = time.perf_counter() - t
    res["ptdstream_rss_added"] = peak.added
    t = time.perf_counter()
    for key, w in weights.items():
        store.add_named_data(key, w.view(w.shape), alignment=16, external_tag="aoti_cuda_blob")
    torch.cuda.synchronize()
    res["readd_same_storage_s"] = time.perf_counter() - t
    copies = {k: w.clone() for k, w in weights.items()}
    torch.cuda.synchronize()
    t = time.perf_counter()
    for key, w in copies.items():
        store.add_named_data(key, w, alignment=16, external_tag="aoti_cuda_blob")
    torch.cuda.synchronize()
    res["readd_equal_copy_s"] = time.perf_counter() - t
    del copies
    ptd = os.path.join(out, "aoti_cuda_blob.ptd")
    res["ptd_bytes"] = os.path.getsize(ptd)
    os.remove(ptd)

    # ptdstream with O_DIRECT writes (same store, fresh file).
    t = time.perf_counter()
    reports = write_data_files(store, out, chunk_nbytes=piece, direct=True)
    res["ptdstream_direct_s"] = time.perf_counter() - t
    res["ptd_direct_identical_size"] = reports[0].nbytes == res["ptd_bytes"]
    os.remove(ptd)

    # Buffered saves with other windows and writeback depths, with timelines.
    from ptdstream.system import writeback as writeback_module
    from ptdstream.timeline import record_stages

    default_inflight = writeback_module.DEFAULT_INFLIGHT_WINDOWS
    res["sweep"] = []
    for window_mib, inflight in sweep:
        writeback_module.DEFAULT_INFLIGHT_WINDOWS = inflight
        try:
            with record_stages() as timeline:
                t = time.perf_counter()
                write_data_files(store, out, chunk_nbytes=piece, direct=False,
                                 window_nbytes=window_mib << 20)
                seconds = time.perf_counter() - t
        finally:
            writeback_module.DEFAULT_INFLIGHT_WINDOWS = default_inflight
        res["sweep"].append({"window_mib": window_mib, "inflight": inflight, "s": seconds,
                             "timeline": timeline.to_dict()})
        os.remove(ptd)

    # Raw write + fsync of the same byte count.
    buf = memoryview(bytearray(64 << 20))
    path = os.path.join(out, "raw.bin")
    res["raw_s"] = raw_write_fsync(path, res["ptd_bytes"], buf)
    os.remove(path)
    res["alternate"] = alternate(store, out, piece, res["ptd_bytes"], rounds)

    # Upstream-style: pageable 8 MiB .cpu() chunks + SHA-256 + write + fsync.
    if not upstream_style:
        res["upstream_style_s"] = float("nan")
        return res
    path = os.path.join(out, "upstream.bin")
    t = time.perf_counter()
    with open(path, "wb") as f:
        for w in weights.values():
            f8 = w.view(-1).view(torch.uint8)
            sha = hashlib.sha256()
            for i in range(0, f8.numel(), 8 << 20):
                chunk = f8[i : i + (8 << 20)].cpu().numpy()
                sha.update(chunk)
                f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    res["upstream_style_s"] = time.perf_counter() - t
    os.remove(path)
    return res


def table(results) -> str:
    lines = []
    head = f"{'GiB':>4} {'path':<34} {'seconds':>8} {'GB/s':>7} {'x slower-of(raw,copy)':>22} {'x upstream-style':>17}"
    lines += [head, "-" * len(head)]
    for r in results:
        n = r["bytes"]
        floor = max(r["raw_s"], r["pinned_copy_s"])
        for name, key in (("ptdstream CUDA -> .ptd, buffered", "ptdstream_s"),
                          ("ptdstream CUDA -> .ptd, O_DIRECT", "ptdstream_direct_s"),
                          ("pinned D2H copy alone", "pinned_copy_s"),
                          ("raw write + fsync", "raw_s"), ("upstream-style (.cpu+sha256+write)", "upstream_style_s")):
            s = r[key]
            lines.append(f"{r['gib']:>4} {name:<34} {s:>8.2f} {n / s / 1e9:>7.2f} {floor / s:>22.3f} "
                         f"{r['upstream_style_s'] / s:>17.2f}")
        lines.append(f"{r['gib']:>4} {'GPU fingerprint':<34} {r['fingerprint_s']:>8.3f} "
                     f"{n / r['fingerprint_s'] / 1e9:>7.0f}")
        lines.append(f"     second method, same storages: {r['readd_same_storage_s'] * 1e3:.2f} ms "
                     f"({100 * r['readd_same_storage_s'] / r['ptdstream_s']:.3f}% of the first write); "
                     f"equal copies: {r['readd_equal_copy_s'] * 1e3:.1f} ms "
                     f"({100 * r['readd_equal_copy_s'] / r['ptdstream_s']:.3f}%)")
        lines.append(f"     host RSS added by the ptdstream save: {r['ptdstream_rss_added'] / 2**20:.1f} MiB")
        for row in r.get("sweep", ()):
            lines.append(f"     buffered, window {row['window_mib']} MiB x {row['inflight']} in writeback: "
                         f"{row['s']:.2f} s, {n / row['s'] / 1e9:.2f} GB/s, {r['raw_s'] / row['s']:.3f}x raw")
            lines += timeline_lines(row["timeline"], indent="         ")
        rows = r.get("alternate") or []
        if rows:
            lines.append(f"     alternating rounds ({len(rows)}), seconds (x raw of the round):")
            for i, row in enumerate(rows, 1):
                lines.append(f"       {i}: order {' > '.join(row['order'])}: raw {row['raw']:.2f}, "
                             f"buffered {row['buffered']:.2f} ({row['raw'] / row['buffered']:.3f}x), "
                             f"O_DIRECT {row['direct']:.2f} ({row['raw'] / row['direct']:.3f}x)")
            med = {m: statistics.median(row[m] for row in rows) for m in ("raw", "buffered", "direct")}
            wins = sum(row["buffered"] < row["direct"] for row in rows)
            lines.append(f"       median: raw {med['raw']:.2f}, buffered {med['buffered']:.2f} "
                         f"({med['raw'] / med['buffered']:.3f}x), O_DIRECT {med['direct']:.2f} "
                         f"({med['raw'] / med['direct']:.3f}x); buffered faster in {wins} of {len(rows)}")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-gib", type=int, nargs="+", default=[8, 32])
    p.add_argument("--out", default="./bench-cuda-out")
    p.add_argument("--piece-mib", type=int, default=8)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--sweep", nargs="*", default=[], metavar="WINDOW_MIB:INFLIGHT",
                   help="extra buffered saves, e.g. 64:4 128:8 256:8")
    p.add_argument("--skip-upstream-style", action="store_true",
                   help="leave out the upstream-style row (its column is then nan)")
    p.add_argument("--alternate", type=int, default=0, metavar="N",
                   help="N rounds of raw / buffered / O_DIRECT writes of the same bytes, order rotated")
    args = p.parse_args()
    sweep = [tuple(int(x) for x in item.split(":")) for item in args.sweep]
    results = []
    try:
        for size in args.sizes_gib:
            results.append(run(size, args.out, args.piece_mib << 20, sweep, not args.skip_upstream_style,
                               args.alternate))
            print(table(results[-1:]), flush=True)
    finally:
        shutil.rmtree(args.out, ignore_errors=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
