"""Whole export + save without holding the weights: peak host RSS added and wall time,
real weights (upstream, ptdstream by reference) vs ``ptdstream.weights_from``.

    python benchmarks/bench_weightless.py --gib 1 --out /tmp/bench-weightless
    python benchmarks/bench_weightless.py --model llama --gib 1 4 --xnnpack --keep-checkpoint /big/ckpt
    python benchmarks/bench_weightless.py --model llama --hidden 4096 --intermediate 11008 --layers 32 \
        --dtype bfloat16 --variants weightless --keep-checkpoint /big/ckpt     # Llama-2-7B-shaped
    python benchmarks/bench_weightless.py --model llama --gib 1 --dtype bfloat16 --xnnpack --seq 512 \
        --use-custom-sdpa --use-custom-kv-cache \
        --variants optimum optimum-weightless optimum-weightless-kept-heap  # optimum's usual flags

With ``--model mlp`` (the default) the model is ``round(gib * 16)`` x ``nn.Linear(4096, 4096, bias=False)`` (64 MiB
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

With ``--model llama`` the model is a ``transformers.LlamaForCausalLM`` (untied,
head dim 128, ``forward(input_ids) -> logits`` without a cache, ``--seq``
tokens) of hidden 2048, intermediate 5632, vocab 32000 and as many layers as
bring the weights nearest each ``--gib`` size (or the given ``--hidden``,
``--intermediate``, ``--vocab``, ``--layers``), in ``--dtype`` (fp32 by
default). Its random checkpoint is a Hugging Face folder written tensor by
tensor (``_weightless_llama.py``), kept under ``--keep-checkpoint`` for the next
run. ``upstream``/``by-reference`` read it into memory (an empty model, the
tensors assigned, as ``from_pretrained`` does), ``mapped`` assigns the mapped
tensors, ``weightless`` binds with the key map of the wrapper's FQNs. Two more
variants go through optimum-executorch's ``main_export`` (text-generation,
static cache of ``--seq`` positions, recipe ``portable`` or ``xnnpack``, the
weights inside the ``.pte``) with ptdstream saving: ``optimum`` (loaded
weights) and ``optimum-weightless`` (``ptdstream.hf.export(..., weightless=True)``),
compared with each other; ``optimum-weightless-kept-heap`` is ``optimum-weightless``
with the C heap never handed back (``ptdstream.weightless.lowering.TRIM_HEAP =
False``: how it ran before; a before/after in one run). optimum's usual flags
(its README's): ``--use-custom-sdpa --use-custom-kv-cache --seq 512 --dtype bfloat16``.

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
from _measure import RssSampler, digests_then_discard, record_peaks, reset_peak_rss, status_kib, upstream_save

GiB = 1 << 30
MiB = 1 << 20
WIDTH = 4096
VARIANTS = ("upstream", "by-reference", "mapped", "weightless", "optimum", "optimum-weightless",
            "optimum-weightless-kept-heap")
DEFAULT_VARIANTS = ("upstream", "by-reference", "mapped", "weightless")
TARGET_NBYTES = 512 * MiB
FLAT_NBYTES = 64 * MiB  # weightless's peak at two sizes may differ by this much


def factory(layers: int):
    import torch

    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])


def prepare(args) -> dict:
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
    dtype = getattr(torch, args.checkpoint_dtype)
    save_file({k: v.to(dtype).contiguous() for k, v in factory(args.layers).state_dict().items()},
              args.checkpoint + ".tmp")
    os.replace(args.checkpoint + ".tmp", args.checkpoint)  # a kept checkpoint is whole or absent
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

    if args.model == "llama":
        import _weightless_llama as llama
        import transformers  # noqa: F401 - import cost only
        if args.variant.startswith("optimum"):
            import optimum.exporters.executorch  # noqa: F401 - import cost only

            import ptdstream.hf

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
    example = (torch.randn(1, WIDTH),) if args.model == "mlp" else (
        torch.arange(args.seq, dtype=torch.long).unsqueeze(0) % args.vocab,)
    t0 = time.perf_counter()
    if args.variant.startswith("optimum"):
        if args.variant == "optimum-weightless-kept-heap":
            import ptdstream.weightless.lowering

            ptdstream.weightless.lowering.TRIM_HEAP = False
        flags = {k: True for k in ("use_custom_sdpa", "use_custom_kv_cache") if getattr(args, k)}
        ptdstream.hf.export(args.checkpoint, out, task="text-generation",
                            recipe="xnnpack" if args.xnnpack else "portable", max_seq_len=args.seq,
                            dtype=args.dtype, weightless=args.variant.startswith("optimum-weightless"), **flags)
        res["export_s"], res["save_s"] = time.perf_counter() - t0, 0.0
    elif args.variant == "weightless" and args.model == "llama":
        with ptdstream.weights_from(args.checkpoint) as weights:
            model = weights.model(lambda: llama.build(args))
            program = torch.export.export(llama.Logits.wrap(model), example, strict=args.strict)
            program, partitioner, config, (_, _, to_edge) = lower(program, example, args, False)
            weights.bind(program, key_map=llama.key_map(model))
            manager = to_edge(program, partitioner=partitioner).to_executorch(config)
            res["export_s"] = time.perf_counter() - t0
            t = time.perf_counter()
            ptdstream.save(manager, os.path.join(out, "model.pte"))
            res["save_s"] = time.perf_counter() - t
    elif args.variant == "weightless":
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
        if args.model == "llama":
            model = llama.Logits.wrap(llama.loaded(args, args.checkpoint, args.variant == "mapped"))
        elif args.variant == "mapped":
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
    record_peaks(res, peaks)
    res["files"] = digests_then_discard(out)
    return res


def run_child(args, variant: str) -> dict:
    result = os.path.join(args.out, "result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--layers", str(args.layers),
           "--out", args.out, "--result", result, "--checkpoint", args.checkpoint, "--model", args.model,
           "--hidden", str(args.hidden), "--intermediate", str(args.intermediate), "--vocab", str(args.vocab),
           "--dtype", args.dtype, "--seq", str(args.seq)]
    cmd += ["--strict"] * args.strict + ["--xnnpack"] * args.xnnpack + ["--checkpoint-dtype", args.checkpoint_dtype]
    cmd += ["--use-custom-sdpa"] * args.use_custom_sdpa + ["--use-custom-kv-cache"] * args.use_custom_kv_cache
    print(f"[{time.strftime('%H:%M:%S')}] {variant}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    os.sync()
    with open(result) as f:
        return json.load(f)


def table(results: dict, weights_nbytes: int) -> str:
    width = max(18, *map(len, results))
    head = (f"{'variant':<{width}} {'weights GiB':>11} {'export s':>8} {'save s':>7} {'total s':>7} "
            f"{'peak+ GiB':>9} {'anon+ GiB':>9} {'file GiB':>8} {'identical':>9}")
    lines = [head, "-" * len(head)]
    up = results.get("upstream")
    verdicts = []
    for variant, r in results.items():
        added = r["peak_rss"] - r["rss_after_imports"]
        anon = r["peak_anon"] - r["anon_after_imports"]
        ref = results.get("optimum") if variant.startswith("optimum") else up
        same = "ref" if variant in ("upstream", "optimum") else ("n/a" if ref is None else
                                                               ("yes" if r["files"] == ref["files"] else "NO"))
        lines.append(f"{variant:<{width}} {weights_nbytes / GiB:>11.2f} {r['export_s']:>8.1f} {r['save_s']:>7.2f} "
                     f"{r['total_s']:>7.1f} {added / GiB:>9.2f} {anon / GiB:>9.2f} {r['peak_file'] / GiB:>8.2f} "
                     f"{same:>9}")
        if variant in ("weightless", "optimum-weightless", "optimum-weightless-kept-heap"):
            verdicts.append((f"{variant}: peak added <= {TARGET_NBYTES // MiB} MiB", added <= TARGET_NBYTES))
            if ref is not None:
                verdicts.append((f"{variant}: byte-identical to {'optimum' if ref is not up else 'upstream'}",
                                 same == "yes"))
                verdicts.append((f"{variant}: no slower than {'optimum' if ref is not up else 'upstream'} "
                                 f"({r['total_s']:.1f} vs {ref['total_s']:.1f} s, 5% allowed)",
                                 r["total_s"] <= 1.05 * ref["total_s"]))
    lines.append("")
    lines += [f"{'PASS' if ok else 'FAIL'} {what}" for what, ok in verdicts]
    return "\n".join(lines)


def added_nbytes(r: dict) -> int:
    return r["peak_rss"] - r["rss_after_imports"]


def flat_verdicts(by_size: dict) -> list[str]:
    """Each weightless variant run at two sizes or more: its peaks within FLAT_NBYTES."""
    lines = []
    for variant in ("weightless", "optimum-weightless", "optimum-weightless-kept-heap"):
        peaks = [added_nbytes(rs[variant]) for rs in by_size.values() if variant in rs]
        if len(peaks) > 1:
            spread = max(peaks) - min(peaks)
            lines.append(f"{'PASS' if spread <= FLAT_NBYTES else 'FAIL'} {variant}: flat in size "
                         f"(peaks within {FLAT_NBYTES // MiB} MiB: spread {spread / MiB:.0f} MiB)")
    return lines


def sized(args, gib: float | None) -> argparse.Namespace:
    """``args`` for one size: layers, weight bytes and the checkpoint's path."""
    a = argparse.Namespace(**vars(args))
    base = args.keep_checkpoint or args.out
    if args.model == "llama":
        import _weightless_llama as llama

        itemsize = 4 if args.dtype == "float32" else 2
        a.layers = args.layers or llama.layers_for(gib, a, itemsize)
        a.checkpoint = os.path.join(base, llama.folder_name(a))
    else:
        a.layers = args.layers or max(1, round(gib * GiB / (WIDTH * WIDTH * 4)))
        a.checkpoint = os.path.join(base, f"mlp-l{a.layers}.safetensors")
    return a


def prepare_llama(args) -> dict:
    import _weightless_llama as llama

    return {"weights_nbytes": llama.write_checkpoint(args, args.checkpoint)}


def main() -> int:
    import _weightless_llama as llama

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("mlp", "llama"), default="mlp")
    p.add_argument("--gib", type=float, nargs="+", default=[1.0],
                   help="weight sizes (GiB), each a run of every variant (ignored with --layers)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS),
                   help="optimum and optimum-weightless need --model llama")
    p.add_argument("--out", default="./bench-weightless-out", help="scratch folder (removed at the end)")
    p.add_argument("--keep-checkpoint", metavar="PATH",
                   help="keep each size's checkpoint under PATH and reuse it when there (default: in --out)")
    p.add_argument("--strict", action="store_true", help="torch.export(strict=True) (dynamo) in every variant")
    p.add_argument("--xnnpack", action="store_true",
                   help="XNNPACK with the weights tagged to a .ptd (delegate_external_constants_pass_unlifted)")
    p.add_argument("--checkpoint-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the checkpoint's dtype (the export is fp32: weightless converts per piece)")
    p.add_argument("--layers", type=int, help="the model's layers (instead of --gib)")
    p.add_argument("--hidden", type=int, default=llama.DEFAULT_SHAPE["hidden"], help="llama: hidden size")
    p.add_argument("--intermediate", type=int, default=llama.DEFAULT_SHAPE["intermediate"],
                   help="llama: MLP size")
    p.add_argument("--vocab", type=int, default=llama.DEFAULT_SHAPE["vocab"], help="llama: vocabulary")
    p.add_argument("--dtype", choices=tuple(llama.SAFETENSORS_DTYPES), default="float32",
                   help="llama: weights' and export's dtype")
    p.add_argument("--seq", type=int, default=8, help="llama: tokens of the example (and optimum's max_seq_len)")
    p.add_argument("--use-custom-sdpa", action="store_true",
                   help="optimum variants: optimum's --use_custom_sdpa (executorch's custom SDPA op)")
    p.add_argument("--use-custom-kv-cache", action="store_true",
                   help="optimum variants: optimum's --use_custom_kv_cache (its custom KV cache)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.variant = args.child
        if args.child == "prepare":
            res = prepare_llama(args) if args.model == "llama" else prepare(args)
        else:
            res = child(args)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return 0
    if args.model == "mlp" and any(v.startswith("optimum") for v in args.variants):
        p.error("the optimum variants export a Hugging Face model: add --model llama")
    os.makedirs(args.out, exist_ok=True)
    by_size: dict[str, dict] = {}
    texts = []
    try:
        for gib in [None] if args.layers else args.gib:
            a = sized(args, gib)
            if args.model == "llama":
                weights_nbytes = run_child(a, "prepare")["weights_nbytes"]
            else:
                weights_nbytes = a.layers * WIDTH * WIDTH * 4
                if not os.path.exists(a.checkpoint):
                    run_child(a, "prepare")
            dtype = args.dtype if args.model == "llama" else "float32"
            label = f"{args.model} {a.layers} layers, {weights_nbytes / GiB:.2f} GiB {dtype}"
            results = by_size[label] = {}
            for variant in args.variants:
                results[variant] = run_child(a, variant)
                print(table(results, weights_nbytes), flush=True)
            texts.append(f"{label}:\n{table(results, weights_nbytes)}")
    finally:
        shutil.rmtree(args.out, ignore_errors=True)
    text = "\n\n".join(texts + ["\n".join(flat_verdicts(by_size))])
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(by_size, f, indent=2)
    return 1 if "FAIL " in text else 0


if __name__ == "__main__":
    raise SystemExit(main())
