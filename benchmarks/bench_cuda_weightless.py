"""executorch's CUDA backend on a checkpoint: upstream on real weights vs ``weights_from`` (the host holds none).

Run on a GPU machine (side by side, one run):

    python benchmarks/bench_cuda_weightless.py --gib 2 --out /tmp/bench-cuda-weightless

The model is bench_cuda_backend.py's: ``--layers`` x ``nn.Linear(dim, dim)`` in
bf16 (``dim`` grows so that the weights total ``--gib``), exported once per
batch size (``--batches``, methods ``batch1``...), lowered with
``to_edge_transform_and_lower`` and one ``CudaPartitioner`` per method, then
``to_executorch`` and saved. Its random checkpoint (``model.safetensors``,
tensor ``i`` from seed ``i``) is written once into ``--out`` (``--stored
float32`` writes it in fp32: the weightless route converts per piece).
``--quantize int4``: the CUDA backend's int4 weight-only (torchao's
``Int4WeightOnlyConfig``, group 32, ``tile_packed_to_4d``, HQQ), with Linear
layers without bias (a Llama's): upstream moves the loaded model to the GPU and
runs ``quantize_``; the weightless route runs ``quantize_(model, config,
device="cuda")`` on the storage-less model (each weight read from the file to the
GPU, quantized there, the bf16 weight freed); both export with inputs on the
GPU. Each variant runs in its own fresh Python process, one after the other:

* ``upstream``: the model built on the host with the checkpoint's tensors loaded
  (``safetensors.torch.load_file``: real weights in memory), exported, lowered as
  executorch 1.5.1 does it and saved with ``write_to_file`` +
  ``write_tensor_data_to_file``;
* ``weightless``: the model built with storage-less parameters inside
  ``ptdstream.weights_from(checkpoint)``, bound after ``torch.export``, lowered
  inside ``ptdstream.stream_cuda_weights()`` (each bound weight loaded from the
  file straight to the GPU through the pinned ring, once for every method:
  ``weightless/to_device.py``) and saved with ``ptdstream.save``.

Per variant: wall time of export + lowering + save (and each), host RSS peak
over the RSS before the model is built (CUDA context included in the
baseline), and the same for ``RssAnon`` and ``RssFile`` apart (``/proc/self/status``,
sampled every 5 ms), GPU peak (``max_memory_allocated``, over the allocation
before lowering), and the xxh3-128 of every file written: the ``.ptd`` must
equal upstream's, the ``.pte`` (which holds the AOTI ``.so`` compiled in its own
process) equals upstream's serializer on the same manager (checked in the child).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import RssSampler, file_digests, record_peaks, status_kib, upstream_save

GiB = 1 << 30


def write_checkpoint(args, path: str) -> int:
    """The model's random checkpoint (tensor ``i`` from seed ``i``), in ``args.stored``; its weight bytes."""
    import safetensors.torch as st
    import torch

    state = {}
    for i in range(args.layers):
        g = torch.Generator().manual_seed(2 * i)
        state[f"{i}.weight"] = (torch.randn(args.dim, args.dim, generator=g) * 0.02).to(torch.bfloat16)
        if not args.quantize:
            g = torch.Generator().manual_seed(2 * i + 1)
            state[f"{i}.bias"] = (torch.randn(args.dim, generator=g) * 0.02).to(torch.bfloat16)
    stored = getattr(torch, args.stored)
    st.save_file({k: v.to(stored) for k, v in state.items()}, path)
    return sum(v.numel() * 2 for v in state.values())


def child(args) -> dict:
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    from executorch.backends.cuda.cuda_backend import CudaBackend
    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    import ptdstream

    ckpt = os.path.join(args.out, "model.safetensors")
    out = os.path.join(args.out, args.child)
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        os.remove(os.path.join(out, name))
    torch.cuda.synchronize()
    res: dict = {"variant": args.child, "gpu": torch.cuda.get_device_name()}
    base = {f: status_kib(f) * 1024 for f in ("VmRSS", "RssAnon", "RssFile")}
    rss = RssSampler(("VmRSS", "RssAnon", "RssFile"))

    def make():
        return torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim, dtype=torch.bfloat16,
                                                     bias=not args.quantize)
                                     for _ in range(args.layers)]).eval()

    def int4():
        from torchao.quantization import Int4WeightOnlyConfig

        return Int4WeightOnlyConfig(group_size=32, int4_packing_format="tile_packed_to_4d",
                                    int4_choose_qparams_algorithm="hqq")

    on = "cuda" if args.quantize else "cpu"

    def lower(export) -> tuple:
        t = time.perf_counter()
        programs = {f"batch{b}": export((torch.randn(b, args.dim, dtype=torch.bfloat16, device=on),))
                    for b in args.batches}
        res["export_s"] = time.perf_counter() - t
        partitioners = {n: [CudaPartitioner([CudaBackend.generate_method_name_compile_spec(n)])] for n in programs}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gpu0 = torch.cuda.memory_allocated()
        res["gpu_held_before_lowering"] = gpu0
        t = time.perf_counter()
        edge = to_edge_transform_and_lower(programs, partitioner=partitioners,
                                           compile_config=EdgeCompileConfig(_check_ir_validity=False))
        manager = edge.to_executorch()
        torch.cuda.synchronize()
        res["lower_s"] = time.perf_counter() - t
        res["gpu_peak_lowering"] = torch.cuda.max_memory_allocated() - gpu0
        return manager, gpu0

    t0 = time.perf_counter()
    if args.child == "upstream":
        import safetensors.torch as st

        model = make()
        model.load_state_dict({k: v.to(torch.bfloat16) for k, v in st.load_file(ckpt).items()})
        if args.quantize:
            from torchao.quantization import quantize_

            t = time.perf_counter()
            model.cuda()
            quantize_(model, int4())
            torch.cuda.synchronize()
            res["quantize_s"] = time.perf_counter() - t
        manager, gpu0 = lower(lambda inputs: torch.export.export(model, inputs, strict=False))
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        upstream_save(manager, out)
        res["save_s"] = time.perf_counter() - t
    else:
        with ptdstream.weights_from(ckpt) as weights, ptdstream.stream_cuda_weights() as stats:
            model = weights.model(make)
            if args.quantize:
                from torchao.quantization import quantize_

                t = time.perf_counter()
                quantize_(model, int4(), device="cuda")
                torch.cuda.synchronize()
                res["quantize_s"] = time.perf_counter() - t
                res["gpu_peak_quantize"] = torch.cuda.max_memory_allocated()
            manager, gpu0 = lower(lambda inputs: weights.bind(torch.export.export(model, inputs, strict=False)))
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            ptdstream.save(manager, os.path.join(out, "model.pte"))
            res["save_s"] = time.perf_counter() - t
            res["loads"] = {k: v for k, v in vars(weights.device_loads.stats).items()}
            res["stream"] = vars(stats).copy()
        with open(os.path.join(args.out, "upstream-serializer.pte"), "wb") as f:
            manager.write_to_file(f)  # upstream's serializer on the same manager: the .pte only
        res["pte_equals_upstream_serializer"] = (
            open(os.path.join(args.out, "upstream-serializer.pte"), "rb").read()
            == open(os.path.join(out, "model.pte"), "rb").read())
    torch.cuda.synchronize()
    res["gpu_peak_save"] = torch.cuda.max_memory_allocated() - gpu0
    res["total_s"] = time.perf_counter() - t0
    peaks = rss.stop()
    record_peaks(res, peaks)
    res["rss_added"] = res["peak_rss"] - base["VmRSS"]
    res["anon_added"] = res["peak_anon"] - base["RssAnon"]
    res["file_added"] = res["peak_file"] - base["RssFile"]
    res["files"] = file_digests(out)
    return res


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="weights (GiB, bf16)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="one method per batch size")
    p.add_argument("--stored", default="bfloat16", choices=["bfloat16", "float32"], help="checkpoint dtype")
    p.add_argument("--variants", nargs="+", default=["upstream", "weightless"])
    p.add_argument("--quantize", choices=["int4"], help="the CUDA backend's int4 weight-only, tile-packed")
    p.add_argument("--out", required=True)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--dim", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return 0
    args.dim = max(64, int((args.gib * GiB / 2 / args.layers) ** 0.5) // 64 * 64)
    os.makedirs(args.out, exist_ok=True)
    weights_nbytes = write_checkpoint(args, os.path.join(args.out, "model.safetensors"))
    results = []
    for variant in args.variants:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--out", args.out, "--dim",
               str(args.dim), "--layers", str(args.layers), "--stored", args.stored, "--batches",
               *map(str, args.batches), *(["--quantize", args.quantize] if args.quantize else [])]
        run = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
        if run.returncode or not lines:
            print(f"{variant}: failed (exit {run.returncode})\n{run.stderr[-4000:]}", file=sys.stderr)
            results.append({"variant": variant, "failed": run.returncode})
            continue
        results.append(json.loads(lines[-1][len("RESULT "):]))
    by = {r["variant"]: r for r in results if "failed" not in r}
    print(f"{len(args.batches)} methods, {args.layers} x Linear({args.dim}) bf16: weights {_gib(weights_nbytes)}, "
          f"checkpoint {args.stored}{', int4 tile-packed (group 32, HQQ)' if args.quantize else ''}; "
          f"{next(iter(by.values()), {}).get('gpu', '?')}")
    print(f"{'variant':<11} {'total s':>8} {'export':>7} {'lower':>7} {'save':>6} {'RSS+':>10} {'anon+':>10} "
          f"{'file+':>10} {'GPU held':>10} {'GPU lower':>10} {'GPU save':>10} {'quant s':>8}")
    for r in results:
        if "failed" in r:
            print(f"{r['variant']:<11} failed (exit {r['failed']})")
            continue
        print(f"{r['variant']:<11} {r['total_s']:8.1f} {r['export_s']:7.1f} {r['lower_s']:7.1f} {r['save_s']:6.1f} "
              f"{_gib(r['rss_added']):>10} {_gib(r['anon_added']):>10} {_gib(r['file_added']):>10} "
              f"{_gib(r['gpu_held_before_lowering']):>10} {_gib(r['gpu_peak_lowering']):>10} "
              f"{_gib(r['gpu_peak_save']):>10} {r.get('quantize_s', 0.0):8.1f}")
    if "upstream" in by and "weightless" in by:
        up, ours = by["upstream"]["files"], by["weightless"]["files"]
        ptds = sorted(n for n in up if n.endswith(".ptd"))
        same = bool(ptds) and all(ours.get(n) == up[n] for n in ptds)
        print(f".ptd identical to upstream's: {same} ({', '.join(ptds)}); .pte equals upstream's serializer on the "
              f"same manager: {by['weightless']['pte_equals_upstream_serializer']}; .pte equals upstream's "
              f"(compiled in another process): {ours.get('model.pte') == up.get('model.pte')}")
    if "weightless" in by:
        print(f"weightless loads: {by['weightless']['loads']}")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"weights_nbytes": weights_nbytes, "args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
