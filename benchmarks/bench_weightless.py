"""Whole export + save without holding the weights: peak host RSS added and wall time,
real weights (upstream, ptdstream by reference) vs ``ptdstream.weights_from``.

    python benchmarks/bench_weightless.py --gib 1 --out /tmp/bench-weightless

The model is ``round(gib * 16)`` x ``nn.Linear(4096, 4096, bias=False)`` (64 MiB
each in fp32), exported to the portable backend with external constants
(``torch.export`` (``strict=False`` unless ``--strict``) -> ``to_edge_transform_and_lower`` -> ``to_executorch(
ExecutorchBackendConfig(external_constants=True))``) and saved. A first process
writes its random weights to a safetensors checkpoint; then each variant runs in
a fresh Python process:

* ``upstream``: the model built with its weights in memory (the same seed, so
  the same bytes), exported, ``write_to_file`` + ``write_tensor_data_to_file`` +
  ``fsync``;
* ``by-reference``: the same model, ``to_executorch()`` inside
  ``ptdstream.constants_by_reference()``, then ``ptdstream.save``;
* ``mapped``: as ``by-reference``, the model built on the meta device and the
  checkpoint's mapped tensors assigned (``safetensors.torch.load_file``,
  ``load_state_dict(assign=True)``): real weights that are file pages;
* ``weightless``: ``with ptdstream.weights_from(checkpoint) as weights``: the model
  from ``weights.model(factory)`` (storage-less parameters), ``weights.export``,
  lowered, emitted and saved with ``ptdstream.save`` inside the block.

With ``--checkpoint-dtype bfloat16`` (or ``float16``) the checkpoint is stored
in that dtype and the export stays fp32: weightless converts each tensor piece
by piece into a temporary file (``weights_from``'s converted route); the
real-weight variants hold the checkpoint's values ``.to(float32)`` (``mapped``
converts the loaded tensors whole, as a user would).

With ``--xnnpack`` every variant lowers to XNNPACK with the weights tagged to a
``.ptd`` (``program.module()``, ``delegate_external_constants_pass_unlifted``,
re-exported; weightless binds that second program), the real-weight ptdstream
variants inside ``ptdstream.xnnpack_constants_by_reference()`` as well.

Peak RSS added is the larger of ``VmHWM`` (reset after the imports) and a 5 ms
``VmRSS`` sampler, over the RSS after the imports (the loaded weights count, as
they do for a user). Every variant's files are compared (xxh3-128) with
upstream's. Target: weightless adds at most 512 MiB.
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
from _measure import RssSampler, discard_file, file_digests, files_under, reset_peak_rss, status_kib, upstream_save

GiB = 1 << 30
MiB = 1 << 20
WIDTH = 4096
VARIANTS = ("upstream", "by-reference", "mapped", "weightless")
TARGET_NBYTES = 512 * MiB


def factory(layers: int):
    import torch

    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])


def prepare(args) -> dict:
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    dtype = getattr(torch, args.checkpoint_dtype)
    save_file({k: v.to(dtype).contiguous() for k, v in factory(args.layers).state_dict().items()}, args.checkpoint)
    return {}


def round_trip(model, args) -> None:
    """The model's fp32 weights as the checkpoint holds them, ``.to(checkpoint dtype).to(float32)``, in place."""
    import torch

    if args.checkpoint_dtype != "float32":
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(getattr(torch, args.checkpoint_dtype)))


def lower(program, example, args, by_reference: bool):
    """``to_edge_transform_and_lower`` -> ``to_executorch``: portable with external
    constants, or (``--xnnpack``) XNNPACK with the weights tagged to a .ptd."""
    import contextlib

    import torch
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    import ptdstream

    partitioner = None
    config = ExecutorchBackendConfig(external_constants=True)
    if args.xnnpack:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

        unlifted = program.module()
        delegate_external_constants_pass_unlifted(unlifted, gen_tag_fn=lambda node: "w")
        program = torch.export.export(unlifted, example, strict=False)
        partitioner, config = [XnnpackPartitioner()], ExecutorchBackendConfig()
    return program, partitioner, config, (
        ptdstream.xnnpack_constants_by_reference if by_reference and args.xnnpack else contextlib.nullcontext,
        ptdstream.constants_by_reference if by_reference else contextlib.nullcontext,
        to_edge_transform_and_lower)


def child(args) -> dict:
    import torch
    from safetensors.torch import load_file

    import ptdstream

    if args.xnnpack:  # imported before the baseline, as the portable route's modules are
        import executorch.backends.xnnpack.partition.xnnpack_partitioner
        import executorch.backends.xnnpack.xnnpack_preprocess
        import executorch.exir.passes.external_constants_pass  # noqa: F401 - import cost only

        import ptdstream.hooks.xnnpack
    import ptdstream.weightless

    res = {"rss_after_imports": status_kib("VmRSS") * 1024, "anon_after_imports": status_kib("RssAnon") * 1024}
    reset_peak_rss()
    sampler = RssSampler(("VmRSS", "RssAnon", "RssFile"))
    out = os.path.join(args.out, args.variant)
    os.makedirs(out, exist_ok=True)
    example = (torch.randn(1, WIDTH),)
    t0 = time.perf_counter()
    if args.variant == "weightless":
        with ptdstream.weights_from(args.checkpoint) as weights:
            model = weights.model(lambda: factory(args.layers))
            program = torch.export.export(model, example, strict=args.strict)
            program, partitioner, config, (_, _, to_edge) = lower(program, example, args, False)
            weights.bind(program)
            manager = to_edge(program, partitioner=partitioner).to_executorch(config)
            res["export_s"] = time.perf_counter() - t0
            t = time.perf_counter()
            ptdstream.save(manager, os.path.join(out, "model.pte"))
            res["save_s"] = time.perf_counter() - t
    else:
        if args.variant == "mapped":
            with torch.device("meta"):
                model = factory(args.layers)
            model.load_state_dict({k: v.float() for k, v in load_file(args.checkpoint).items()}, assign=True)
        else:
            torch.manual_seed(0)
            model = factory(args.layers)
            round_trip(model, args)
        program = torch.export.export(model.eval(), example, strict=args.strict)
        program, partitioner, config, (lowering, emitting, to_edge) = lower(
            program, example, args, args.variant != "upstream")
        with lowering():
            edge = to_edge(program, partitioner=partitioner)
        with emitting():
            manager = edge.to_executorch(config)
        res["export_s"] = time.perf_counter() - t0
        t = time.perf_counter()
        if args.variant != "upstream":
            ptdstream.save(manager, os.path.join(out, "model.pte"))
        else:
            upstream_save(manager, out)
        res["save_s"] = time.perf_counter() - t
    res["total_s"] = time.perf_counter() - t0
    peaks = sampler.stop()
    res["peak_rss"] = max(peaks["VmRSS"], status_kib("VmHWM") * 1024)
    res["peak_anon"], res["peak_file"] = peaks["RssAnon"], peaks["RssFile"]
    res["files"] = file_digests(out)
    for p in files_under(out):
        discard_file(p)
    return res


def run_child(args, variant: str) -> dict:
    result = os.path.join(args.out, "result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--layers", str(args.layers),
           "--out", args.out, "--result", result, "--checkpoint", args.checkpoint]
    cmd += ["--strict"] * args.strict + ["--xnnpack"] * args.xnnpack + ["--checkpoint-dtype", args.checkpoint_dtype]
    print(f"[{time.strftime('%H:%M:%S')}] {variant}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    os.sync()
    with open(result) as f:
        return json.load(f)


def table(results: dict, weights_nbytes: int) -> str:
    head = (f"{'variant':<13} {'weights GiB':>11} {'export s':>8} {'save s':>7} {'total s':>7} "
            f"{'peak+ GiB':>9} {'anon+ GiB':>9} {'file GiB':>8} {'identical':>9}")
    lines = [head, "-" * len(head)]
    up = results.get("upstream")
    verdicts = []
    for variant, r in results.items():
        added = r["peak_rss"] - r["rss_after_imports"]
        anon = r["peak_anon"] - r["anon_after_imports"]
        same = "ref" if variant == "upstream" else ("n/a" if up is None else
                                                    ("yes" if r["files"] == up["files"] else "NO"))
        lines.append(f"{variant:<13} {weights_nbytes / GiB:>11.2f} {r['export_s']:>8.1f} {r['save_s']:>7.2f} "
                     f"{r['total_s']:>7.1f} {added / GiB:>9.2f} {anon / GiB:>9.2f} {r['peak_file'] / GiB:>8.2f} "
                     f"{same:>9}")
        if variant == "weightless":
            verdicts.append((f"weightless: peak added <= {TARGET_NBYTES // MiB} MiB", added <= TARGET_NBYTES))
            if up is not None:
                verdicts.append(("weightless: byte-identical to upstream", same == "yes"))
    lines.append("")
    lines += [f"{'PASS' if ok else 'FAIL'} {what}" for what, ok in verdicts]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="fp32 weight size (GiB)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--out", default="./bench-weightless-out", help="scratch folder (removed at the end)")
    p.add_argument("--strict", action="store_true", help="torch.export(strict=True) (dynamo) in every variant")
    p.add_argument("--xnnpack", action="store_true",
                   help="XNNPACK with the weights tagged to a .ptd (delegate_external_constants_pass_unlifted)")
    p.add_argument("--checkpoint-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the checkpoint's dtype (the export is fp32: weightless converts per piece)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.variant = args.child
        res = prepare(args) if args.child == "prepare" else child(args)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return 0
    args.layers = max(1, round(args.gib * GiB / (WIDTH * WIDTH * 4)))
    weights_nbytes = args.layers * WIDTH * WIDTH * 4
    os.makedirs(args.out, exist_ok=True)
    args.checkpoint = os.path.join(args.out, "model.safetensors")
    results = {}
    try:
        run_child(args, "prepare")
        for variant in args.variants:
            results[variant] = run_child(args, variant)
            print(table(results, weights_nbytes), flush=True)
    finally:
        shutil.rmtree(args.out, ignore_errors=True)
    text = table(results, weights_nbytes)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if "\nFAIL " in text else 0


if __name__ == "__main__":
    raise SystemExit(main())
