#!/usr/bin/env python
"""One large weight under HQQ scale-only (optimum's default algorithm), side by side:
torchao's ``quantize_`` on the loaded weight vs ``quantize_`` inside ``weights_from``
(the whole tensor's iterations run over bands of rows: ``ptdstream.weightless.hqq_bands``).

Each case runs in a fresh process (torch, torchao and ptdstream imported first, not
counted): the weight (``--rows`` x ``--cols``, bf16 in a safetensors file, read as
float32 as ``from_pretrained(dtype=float32)`` does) is quantized with
``--config`` (``8w``: ``IntxWeightOnlyConfig`` int8 ``PerAxis(0)``, an embedding;
``8da4w``: ``Int8DynamicActivationIntxWeightConfig`` int4 ``PerGroup(32)``, a
linear). Rows: peak RSS added over the imports (``VmHWM`` reset first) and wall
seconds, both up to the end of ``quantize_``, and the sha256 of the quantized tensors (qdata, scale, zero point),
which must be equal. ``raw``: the float32 weight's own size, for scale; ``x first``:
wall seconds over the first route's. Routes (``--routes``): ``loaded``,
``weights_from``, and ``read_again`` (``weights_from`` with no weight held while its
iterations run: each band read again from the checkpoint at each iteration, as a
weight past ``banded.HELD_NBYTES`` is).

Usage:
    python benchmarks/bench_hqq_bands.py                                  # 32000 x 1536 (the issue shape's embedding)
    python benchmarks/bench_hqq_bands.py --rows 128256 --cols 4096        # an 8B model's embedding (2.1 GB fp32)
    python benchmarks/bench_hqq_bands.py --config 8da4w
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

#: loaded: torchao on the loaded weight; weights_from: banded; read_again: banded, no weight held
#: while its iterations run (each band read again at each iteration).
ROUTES = ("loaded", "weights_from", "read_again")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _child(route: str, path: str, rows: int, cols: int, config_name: str) -> dict:
    import torch
    from torchao.quantization import quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig

    from ptdstream.weightless import weights_from

    if config_name == "8w":
        config = IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0),
                                      intx_choose_qparams_algorithm="hqq_scale_only")
        kind = torch.nn.Embedding
    else:
        config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32),
                                                       intx_choose_qparams_algorithm="hqq_scale_only")
        kind = torch.nn.Linear

    def chosen(module, fqn):
        return isinstance(module, kind)

    def build():
        model = torch.nn.Sequential()
        model.w = torch.nn.Embedding(rows, cols) if kind is torch.nn.Embedding else torch.nn.Linear(cols, rows,
                                                                                                     bias=False)
        return model

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    start = time.perf_counter()
    if route == "loaded":
        import safetensors.torch as st

        with torch.device("meta"):
            model = build()
        model.load_state_dict({"w.weight": st.load_file(path)["w.weight"].to(torch.float32)}, assign=True)
        quantize_(model, config, chosen)
        seconds, peak = time.perf_counter() - start, _status("VmHWM") - base
        digest = _digest(model.w.weight)
    else:
        if route == "read_again":
            from ptdstream.weightless import banded

            banded.HELD_NBYTES = 0
        with weights_from(path) as weights:
            with torch.device("meta"):
                model = weights.model(build())
            quantize_(model, config, chosen)
            seconds, peak = time.perf_counter() - start, _status("VmHWM") - base
            digest = _digest(model.w.weight)
    return {"peak": peak, "seconds": seconds, "sha256": digest}


def _digest(weight) -> str:
    """sha256 of a quantized weight's inner tensors, read in 8 MiB pieces (after the peak is read)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name in weight.__tensor_flatten__()[0]:
        flat = getattr(weight, name).contiguous().view(-1).view(torch.uint8)
        for i in range(0, flat.numel(), 8 << 20):
            digest.update(flat[i:i + (8 << 20)].numpy().tobytes())
    return digest.hexdigest()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32000)
    p.add_argument("--cols", type=int, default=1536)
    p.add_argument("--config", choices=("8w", "8da4w"), default="8w")
    p.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.path, args.rows, args.cols, args.config)))
        return 0
    import torch

    with tempfile.TemporaryDirectory(dir=os.getcwd()) as folder:
        path = os.path.join(folder, "w.safetensors")
        import safetensors.torch as st

        torch.manual_seed(0)
        st.save_file({"w.weight": (torch.randn(args.rows, args.cols) * 0.02).to(torch.bfloat16)}, path)
        results = {}
        for route in args.routes:
            out = subprocess.run([sys.executable, __file__, "--child", route, "--path", path, "--rows",
                                  str(args.rows), "--cols", str(args.cols), "--config", args.config],
                                 capture_output=True, text=True, check=True)
            results[route] = json.loads(out.stdout.strip().splitlines()[-1])
    raw = args.rows * args.cols * 4
    print(f"{args.rows} x {args.cols} ({raw / 2**20:.0f} MiB fp32), {args.config}, hqq_scale_only")
    base = results.get("loaded") or next(iter(results.values()))
    print(f"{'route':<14}{'peak+ MiB':>10}{'x raw':>8}{'wall s':>9}{'x first':>9}  sha256")
    for route, r in results.items():
        print(f"{route:<14}{r['peak'] / 2**20:>10.0f}{r['peak'] / raw:>8.2f}{r['seconds']:>9.1f}"
              f"{r['seconds'] / base['seconds']:>9.2f}  {r['sha256'][:16]}")
    same = len({r["sha256"] for r in results.values()}) == 1
    print(("PASS" if same else "FAIL") + ": the quantized tensors' bytes are equal")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
