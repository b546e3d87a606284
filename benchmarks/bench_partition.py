"""XNNPACK partitioning's host memory: upstream's closure sets vs ``hooks.reachability``'s bitsets.

    python benchmarks/bench_partition.py                      # 3, 18 and 32 layers
    python benchmarks/bench_partition.py --layers 3 18 32 64

A ``transformers.LlamaForCausalLM`` of ``--layers`` layers (head dim 128, the
same graph per layer as ``bench_weightless.py --model llama``; hidden 256 so
the weights are small: the graph, not the weights, is measured) is exported
(``strict=False``, ``forward(input_ids) -> logits``) and lowered with
``to_edge_transform_and_lower(partitioner=[XnnpackPartitioner()])``, then
emitted, in a fresh process per variant and size:

* ``upstream``: as is (torch's and executorch's ``_DependencyViewer``: a ``set``
  of every node downstream, and upstream, of each node);
* ``ptdstream``: inside ``ptdstream.hooks.reachability.compact_dependency_viewers()``.

Reported per run: the graph's nodes, peak RSS added while
``XnnpackPartitioner.partition`` runs (``VmHWM`` reset when it starts, over
the RSS then), its wall time, and whether the ``.pte`` is the same bytes as
upstream's (xxh3-128).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import reset_peak_rss, status_kib

MiB = 1 << 20


def child(variant: str, layers: int) -> dict:
    import contextlib

    import _weightless_llama as llama
    import torch
    import xxhash
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from ptdstream.hooks.reachability import compact_dependency_viewers

    shape = argparse.Namespace(hidden=256, intermediate=704, vocab=1000, layers=layers, dtype="float32", seq=8)
    torch.manual_seed(0)
    model = llama.Logits.wrap(llama.build(shape))
    example = (torch.arange(shape.seq, dtype=torch.long).unsqueeze(0),)
    program = torch.export.export(model, example, strict=False)
    res: dict = {}
    original = XnnpackPartitioner.partition

    def measured(self, exported_program):
        res["nodes"] = len(exported_program.graph.nodes)
        before = status_kib("VmRSS")
        reset_peak_rss()
        t = time.perf_counter()
        out = original(self, exported_program)
        res["partition_s"] = time.perf_counter() - t
        res["peak_added"] = (status_kib("VmHWM") - before) * 1024
        return out

    XnnpackPartitioner.partition = measured
    scope = compact_dependency_viewers if variant == "ptdstream" else contextlib.nullcontext
    with scope():
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    res["digest"] = xxhash.xxh3_128_hexdigest(edge.to_executorch().buffer)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[3, 18, 32])
    p.add_argument("--json", metavar="PATH", help="write the results there too")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return 0
    rows = []
    print(f"{'layers':>6} {'nodes':>6} | {'upstream MiB':>12} {'s':>6} | {'ptdstream MiB':>13} {'s':>6} | "
          f"{'memory ratio':>12} identical (ratio: over 1 MiB at least)", flush=True)
    for layers in args.layers:
        got = {}
        for variant in ("upstream", "ptdstream"):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", variant, str(layers)],
                                 check=True, capture_output=True, text=True).stdout
            got[variant] = json.loads(out.strip().splitlines()[-1])
        up, ours = got["upstream"], got["ptdstream"]
        ratio = up["peak_added"] / max(ours["peak_added"], MiB)  # below 1 MiB counts as 1 MiB
        same = up["digest"] == ours["digest"]
        rows.append({"layers": layers, **{f"{k}_{v}": got[k][v] for k in got for v in got[k]}, "identical": same})
        print(f"{layers:>6} {up['nodes']:>6} | {up['peak_added'] / MiB:>12.1f} {up['partition_s']:>6.2f} | "
              f"{ours['peak_added'] / MiB:>13.1f} {ours['partition_s']:>6.2f} | {ratio:>11.0f}x "
              f"{'yes' if same else 'NO'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
