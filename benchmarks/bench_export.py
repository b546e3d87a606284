"""Whole export + save on the CPU: peak host RSS, upstream vs ptdstream (constants by reference + streamed save).

    python benchmarks/bench_export.py --gib 3 --out /tmp/bench-export

Each case builds ``round(gib * 16)`` x ``nn.Linear(4096, 4096, bias=False)``
(64 MiB each in fp32), exports it (``torch.export`` ->
``to_edge_transform_and_lower``, portable, no delegate -> ``to_executorch``) and
saves it, in a fresh Python process per run:

* ``upstream``: ``to_executorch()`` as is (the emitter copies every constant into
  ``bytes``), then ``write_to_file`` + ``write_tensor_data_to_file`` + ``fsync``;
* ``ptdstream``: ``to_executorch()`` inside ``ptdstream.constants_by_reference()``,
  then ``ptdstream.save``.

Cases: ``fp32-ptd`` (``external_constants=True``: weights in the .ptd),
``fp32-pte`` (weights in the .pte), ``bf16-ptd`` (the same layers in bf16, built
in bf16), ``mmap-ptd`` (fp32 weights loaded with ``torch.load(mmap=True)``
into a model built on the meta device, from a checkpoint written beforehand by
another process).

Peak RSS is the process's ``VmHWM`` (reset after the imports) and a 5 ms
``VmRSS`` sampler, over the RSS right after the imports; ``anon``/``file`` split
it (``RssAnon``/``RssFile``, sampled). Target (ptdstream, every case): peak
added <= 1.1x the weight bytes + 256 MiB; for ``mmap`` the anonymous peak
well under the weight bytes (<= 0.25x). Every run's files are compared
(xxh3-128) with upstream's.
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
from _measure import RssSampler, digests_then_discard, record_peaks, reset_peak_rss, status_kib, upstream_save

GiB = 1 << 30
MiB = 1 << 20
WIDTH = 4096
CASES = ("fp32-ptd", "fp32-pte", "bf16-ptd", "mmap-ptd")


def build(case: str, layers: int, checkpoint: str):
    import torch

    torch.manual_seed(0)
    dtype = torch.bfloat16 if case.startswith("bf16") else torch.float32
    if case.startswith("mmap"):
        with torch.device("meta"):
            model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
        model.load_state_dict(torch.load(checkpoint, mmap=True, weights_only=True), assign=True)
        return model.eval()
    return torch.nn.Sequential(*[
        torch.nn.Linear(WIDTH, WIDTH, bias=False, dtype=dtype) for _ in range(layers)
    ]).eval()


def child(args) -> dict:
    import torch
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    import ptdstream

    if args.case == "prepare":
        model = build("fp32", args.layers, "")
        torch.save(model.state_dict(), args.checkpoint)
        return {}
    res = {"rss_after_imports": status_kib("VmRSS") * 1024, "anon_after_imports": status_kib("RssAnon") * 1024}
    reset_peak_rss()
    sampler = RssSampler(("VmRSS", "RssAnon", "RssFile"))
    t = time.perf_counter()
    model = build(args.case, args.layers, args.checkpoint)
    res["weights_nbytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    res["build_s"] = time.perf_counter() - t
    example = (torch.randn(1, WIDTH, dtype=next(model.parameters()).dtype),)
    t = time.perf_counter()
    edge = to_edge_transform_and_lower(torch.export.export(model, example))
    config = ExecutorchBackendConfig(external_constants=args.case.endswith("-ptd"))
    if args.variant == "ptdstream":
        with ptdstream.constants_by_reference():
            manager = edge.to_executorch(config)
    else:
        manager = edge.to_executorch(config)
    res["export_s"] = time.perf_counter() - t
    res["rss_after_export"] = status_kib("VmRSS") * 1024
    out = os.path.join(args.out, args.variant)
    os.makedirs(out, exist_ok=True)
    t = time.perf_counter()
    if args.variant == "ptdstream":
        ptdstream.save(manager, os.path.join(out, "model.pte"))
    else:
        upstream_save(manager, out)
    res["save_s"] = time.perf_counter() - t
    peaks = sampler.stop()
    record_peaks(res, peaks)
    del manager, edge, model
    res["files"] = digests_then_discard(out)
    return res


def run_child(args, case: str, variant: str) -> dict:
    result = os.path.join(args.out, "result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--variant", variant,
           "--layers", str(args.layers), "--out", args.out, "--result", result,
           "--checkpoint", args.checkpoint]
    print(f"[{time.strftime('%H:%M:%S')}] {case} {variant}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    os.sync()
    with open(result) as f:
        return json.load(f)


def table(results: dict) -> str:
    head = (f"{'case':<9} {'variant':<10} {'weights GiB':>11} {'export s':>8} {'save s':>7} "
            f"{'peak+ GiB':>9} {'x weights':>9} {'anon+ GiB':>9} {'file GiB':>8} {'identical':>9}")
    lines = [head, "-" * len(head)]
    verdicts = []
    for case, runs in results.items():
        up = runs["upstream"]
        for variant in ("upstream", "ptdstream"):
            r = runs[variant]
            w = r["weights_nbytes"]
            added = r["peak_rss"] - r["rss_after_imports"]
            anon = r["peak_anon"] - r["anon_after_imports"]
            same = "ref" if variant == "upstream" else ("yes" if r["files"] == up["files"] else "NO")
            lines.append(f"{case:<9} {variant:<10} {w / GiB:>11.2f} {r['export_s']:>8.1f} {r['save_s']:>7.2f} "
                         f"{added / GiB:>9.2f} {added / w:>9.2f} {anon / GiB:>9.2f} {r['peak_file'] / GiB:>8.2f} "
                         f"{same:>9}")
            if variant == "ptdstream":
                verdicts.append((f"{case}: peak added <= 1.1x weights + 256 MiB", added <= 1.1 * w + 256 * MiB))
                verdicts.append((f"{case}: byte-identical to upstream", same == "yes"))
                if case.startswith("mmap"):
                    verdicts.append((f"{case}: anonymous peak <= 0.25x weights", anon <= 0.25 * w))
    lines.append("")
    lines += [f"{'PASS' if ok else 'FAIL'} {what}" for what, ok in verdicts]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=3.0, help="fp32 weight size (GiB); bf16 is half")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--out", default="./bench-export-out", help="scratch folder (removed at the end)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.case = args.child
        res = child(args)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return 0
    args.layers = max(1, round(args.gib * GiB / (WIDTH * WIDTH * 4)))
    os.makedirs(args.out, exist_ok=True)
    args.checkpoint = os.path.join(args.out, "checkpoint.pt")
    results = {}
    try:
        if any(c.startswith("mmap") for c in args.cases):
            run_child(args, "prepare", "none")
        for case in args.cases:
            results[case] = {v: run_child(args, case, v) for v in ("upstream", "ptdstream")}
            print(table({case: results[case]}), flush=True)
    finally:
        shutil.rmtree(args.out, ignore_errors=True)
    text = table(results)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if "\nFAIL " in text else 0


if __name__ == "__main__":
    raise SystemExit(main())
