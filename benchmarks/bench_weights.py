"""New weights for an exported program: ``ptdstream.weights.write_ptd`` vs the upstream
route vs a raw write of the same bytes; wall time and peak RSS, side by side.

    python benchmarks/bench_weights.py --gib 0.5 --out /tmp/bench-weights     # here
    python benchmarks/bench_weights.py --gib 6 --out /big/disk/bench-weights   # the issue's size

Setup (once, in a child): ``round(gib * 16)`` x ``nn.Linear(4096, 4096, bias=False)``
(64 MiB each, fp32) built with seed 0 (weights A) and exported with
``ExecutorchBackendConfig(external_constants=True)`` (``program.pte``); weights B
(seed 1) saved as ``B.safetensors`` and as a DCP directory ``B.dcp``.

Runs, each in a fresh Python process (peak RSS over the RSS after the imports:
``VmHWM`` reset after them, and a 5 ms sampler), the checkpoint's pages dropped
from the page cache first:

* ``write_ptd safetensors`` / ``write_ptd dcp``: ``write_ptd(program.pte, B, out)``;
* ``upstream``: the model built on the meta device, ``load_state_dict`` of B
  (``safetensors.torch.load_file``, ``assign=True``), ``torch.export`` ->
  ``to_edge_transform_and_lower`` -> ``to_executorch(external_constants=True)``
  -> ``write_tensor_data_to_file`` + ``fsync``;
* ``raw``: the checkpoint's tensor bytes copied into one file (``pread`` +
  ``write`` of 8 MiB pieces, pages dropped) + ``fsync``.

Each method runs ``--repeats`` times (order rotated); the table shows the median
time and the largest peak RSS added. Targets: every ``write_ptd`` output equals upstream's (xxh3-128); ``write_ptd
safetensors`` peak added <= 256 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (
    RssSampler,
    digests_then_discard,
    files_under,
    fsync_files,
    record_peaks,
    reset_peak_rss,
    status_kib,
)

GiB = 1 << 30
MiB = 1 << 20
WIDTH = 4096
PTD = "_default_external_constant.ptd"
METHODS = ("write_ptd safetensors", "write_ptd dcp", "upstream", "raw")


def build(layers: int, seed: int, device: str = "cpu"):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False, device=device) for _ in range(layers)])


def _export(model):
    import torch
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    edge = to_edge_transform_and_lower(torch.export.export(model, (torch.randn(1, WIDTH),)))
    return edge.to_executorch(ExecutorchBackendConfig(external_constants=True))


def prepare(args) -> dict:
    import safetensors.torch as st
    import torch.distributed.checkpoint as dcp

    manager = _export(build(args.layers, 0))
    with open(os.path.join(args.out, "program.pte"), "wb") as f:
        manager.write_to_file(f)
    del manager
    state = build(args.layers, 1).state_dict()
    st.save_file(state, os.path.join(args.out, "B.safetensors"))
    dcp.save(state, checkpoint_id=os.path.join(args.out, "B.dcp"), no_dist=True)
    return {"weights_nbytes": sum(t.numel() * t.element_size() for t in state.values())}


def _raw_copy(src: str, dst: str) -> None:
    """The tensor bytes of a safetensors file into one file, in 8 MiB pieces, then fsync."""
    import struct

    from ptdstream.system.pagecache import drop_pages

    buf = bytearray(8 * MiB)
    view = memoryview(buf)
    fd_in = os.open(src, os.O_RDONLY)
    fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        (header,) = struct.unpack("<Q", os.pread(fd_in, 8, 0))
        offset, end = 8 + header, os.fstat(fd_in).st_size
        while offset < end:
            n = os.preadv(fd_in, [view[: min(len(buf), end - offset)]], offset)
            written = 0
            while written < n:
                written += os.write(fd_out, view[written:n])
            drop_pages(fd_in, offset, n)
            offset += n
        os.fsync(fd_out)
        drop_pages(fd_out, 0, 0)
    finally:
        os.close(fd_in)
        os.close(fd_out)


def _cold(paths) -> None:
    from ptdstream.system.pagecache import drop_pages

    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        drop_pages(fd, 0, 0)
        os.close(fd)


def child(args) -> dict:
    import executorch.exir  # noqa: F401 - imported before the baseline, as torch
    import torch  # noqa: F401 - the imports every method needs, before the baseline

    import ptdstream.weights  # imported before the baseline, as torch

    if args.method == "prepare":
        return prepare(args)
    ckpt_files = [os.path.join(args.out, "B.safetensors")] + files_under(os.path.join(args.out, "B.dcp"))
    _cold(ckpt_files)
    out = os.path.join(args.out, "run")
    os.makedirs(out, exist_ok=True)
    res = {"rss_after_imports": status_kib("VmRSS") * 1024, "anon_after_imports": status_kib("RssAnon") * 1024}
    reset_peak_rss()
    sampler = RssSampler(("VmRSS", "RssAnon", "RssFile"))
    t = time.perf_counter()
    program = os.path.join(args.out, "program.pte")
    if args.method == "write_ptd safetensors":
        ptdstream.weights.write_ptd(program, os.path.join(args.out, "B.safetensors"), out)
    elif args.method == "write_ptd dcp":
        ptdstream.weights.write_ptd(program, os.path.join(args.out, "B.dcp"), out, format="dcp")
    elif args.method == "upstream":
        import safetensors.torch as st

        model = build(args.layers, 0, device="meta")
        model.load_state_dict(st.load_file(os.path.join(args.out, "B.safetensors")), assign=True)
        manager = _export(model)
        manager.write_tensor_data_to_file(out)
        fsync_files(out)
    else:
        _raw_copy(os.path.join(args.out, "B.safetensors"), os.path.join(out, "raw.bin"))
    res["seconds"] = time.perf_counter() - t
    peaks = sampler.stop()
    record_peaks(res, peaks)
    res["files"] = digests_then_discard(out)
    return res


def run_child(args, method: str) -> dict:
    result = os.path.join(args.out, "result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", method, "--gib", str(args.gib), "--out", args.out,
           "--result", result]
    print(f"[{time.strftime('%H:%M:%S')}] {method}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    with open(result) as f:
        return json.load(f)


def _median_run(runs: list) -> dict:
    """The run of median wall time (its own RSS figures with it); the largest peak RSS of all runs."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    out = dict(ordered[len(ordered) // 2])
    out["peak_rss"] = max(r["peak_rss"] - r["rss_after_imports"] for r in runs) + out["rss_after_imports"]
    out["all_seconds"] = [r["seconds"] for r in runs]
    return out


def table(results: dict, weights_nbytes: int) -> str:
    raw_s = results["raw"]["seconds"]
    up = results["upstream"]["files"].get(PTD)
    head = (f"{'method':<22} {'seconds':>8} {'GB/s':>6} {'x raw':>6} {'peak+ MiB':>9} {'anon+ MiB':>9} "
            f"{'file MiB':>8} {'identical':>9}")
    lines = [f"weights: {weights_nbytes / GiB:.2f} GiB ({weights_nbytes:,} bytes)", head, "-" * len(head)]
    verdicts = []
    for method in METHODS:
        r = results[method]
        added = r["peak_rss"] - r["rss_after_imports"]
        anon = r["peak_anon"] - r["anon_after_imports"]
        if method == "upstream":
            same = "ref"
        elif method == "raw":
            same = "-"
        else:
            same = "yes" if r["files"].get(PTD) == up else "NO"
            verdicts.append((f"{method}: byte-identical to upstream", same == "yes"))
        if method == "write_ptd safetensors":
            verdicts.append((f"{method}: peak added <= 256 MiB", added <= 256 * MiB))
        lines.append(f"{method:<22} {r['seconds']:>8.2f} {weights_nbytes / r['seconds'] / 1e9:>6.2f} "
                     f"{r['seconds'] / raw_s:>6.2f} {added / MiB:>9.0f} {anon / MiB:>9.0f} "
                     f"{r['peak_file'] / MiB:>8.0f} {same:>9}")
    lines.append("")
    lines += [f"{'PASS' if ok else 'FAIL'} {what}" for what, ok in verdicts]
    return "\n".join(lines), all(ok for _, ok in verdicts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=6.0, help="weight size in GiB (default 6, the issue's)")
    parser.add_argument("--out", default="./bench-weights", help="scratch folder (created, removed at the end)")
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument("--repeats", type=int, default=3, help="runs per method; median time, largest peak")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.layers = max(1, round(args.gib * 16))
    if args.child:
        args.method = args.child
        res = child(args)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return 0
    os.makedirs(args.out, exist_ok=True)
    try:
        weights_nbytes = run_child(args, "prepare")["weights_nbytes"]
        runs = {m: [] for m in METHODS}
        for repeat in range(args.repeats):
            for i in range(len(METHODS)):  # the order rotates each repeat
                method = METHODS[(i + repeat) % len(METHODS)]
                runs[method].append(run_child(args, method))
        results = {m: _median_run(r) for m, r in runs.items()}
        text, ok = table(results, weights_nbytes)
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"weights_nbytes": weights_nbytes, "results": results}, f, indent=1)
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
