"""A Hugging Face decoder through optimum-executorch: whole export + save, upstream vs ptdstream.

    python benchmarks/bench_hf.py --out /tmp/bench-hf            # ~290 M parameters, fp32 (1.1 GiB)
    python benchmarks/bench_hf.py --layers 2 --out /tmp/bench-hf  # a quick check (~75 M)

Needs ``ptdstream[hf]`` (``bash tools/setup.sh --hf``). No download: a
Llama-style config (vocab 32000, hidden 1024, MLP 2816, 16 query / 4 KV heads,
``--layers`` layers, untied head) gets random weights (seed 0) and is
``save_pretrained`` as safetensors into ``--out/model`` by one child process.
Each variant then runs in a fresh process with ``HF_HUB_OFFLINE=1``:
``optimum.exporters.executorch.main_export(folder, task="text-generation",
recipe="xnnpack", max_seq_len=128)``, which loads the folder (transformers
5.0.0rc1 maps the safetensors file: the weights are file pages, not anonymous
memory), exports, lowers to XNNPACK, emits and saves ``model.pte`` (the xnnpack
recipe of optimum-executorch 1.1.0 keeps every weight in the .pte):

* ``upstream``: as is (executorch's ``write_to_file`` builds the whole file in memory);
* ``install``: inside ``ptdstream.installed()`` (the save streams);
* ``ptdstream``: ``ptdstream.hf.export``: installed, plus
  ``constants_by_reference()`` (the emitter) and ``xnnpack_constants_by_reference()``
  (XNNPACK's node visitor) around the whole export.

Columns: ``export s`` (load + export + lower + emit), ``save s`` (the
``write_to_file`` + ``write_tensor_data_to_file`` calls optimum makes), peak RSS
added over the RSS after the imports (``VmHWM`` reset after the imports and a 5
ms sampler), its anonymous part and the safetensors file pages
(``RssFile``), each in GiB and as a multiple of the weight bytes. ``identical``:
every file's xxh3-128 equals upstream's (separate processes: the export is the
same in each here), and ``same mgr``: in the ptdstream variants, after the
measurement, executorch's own writer writes the same manager again and it is
compared byte for byte. ``outputs``: the ExecuTorch runtime runs each
``model.pte`` on a 5-token prompt; logits equal upstream's (``torch.equal``)
and within 1e-3 of the eager model's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import RssSampler, file_digests, files_under, record_peaks, reset_peak_rss, status_kib, xxh3_file

GiB = 1 << 30
MiB = 1 << 20
VARIANTS = ("upstream", "install", "ptdstream")
PROMPT = [1, 306, 4966, 29871, 13]
MAX_SEQ_LEN = 128


def llama_config(layers: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=MAX_SEQ_LEN,
        tie_word_embeddings=False,
    )


def prepare(args) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.no_grad():
        model = transformers.LlamaForCausalLM(llama_config(args.layers)).eval()
    model.save_pretrained(args.model_dir)
    return {"params": sum(p.numel() for p in model.parameters()),
            "weights_nbytes": sum(p.numel() * p.element_size() for p in model.parameters())}


class PhasePeaks:
    """Largest ``VmRSS`` (bytes) per phase, sampled every 5 ms: ``"export"``
    (load + ``torch.export``) until ``to_edge_transform_and_lower`` starts,
    ``"lower+emit"`` until the first save call, ``"save"`` after."""

    def __init__(self) -> None:
        self.phase = "export"
        self.peak = {"export": 0, "lower+emit": 0, "save": 0}
        self.start = {}  # RSS when each later phase began
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            rss = status_kib("VmRSS") * 1024
            self.peak[self.phase] = max(self.peak[self.phase], rss)
            self._stop.wait(0.005)

    def enter(self, phase: str) -> None:
        rss = status_kib("VmRSS") * 1024
        self.peak[self.phase] = max(self.peak[self.phase], rss)
        if phase != self.phase:
            self.start.setdefault(phase, rss)
        self.phase = phase

    def stop(self) -> dict:
        self.enter(self.phase)
        self._stop.set()
        self._thread.join()
        return dict(self.peak)


def child(args) -> dict:
    import optimum.exporters.executorch.recipes.xnnpack as xnnpack_recipe
    import torch  # noqa: F401 - imported before the export starts
    from executorch.exir import ExecutorchProgramManager
    from optimum.exporters.executorch import main_export

    from ptdstream.hf import saving as pt_optimum
    from ptdstream.hooks import install as patch

    out = os.path.join(args.out, args.variant)
    os.makedirs(out, exist_ok=True)
    if args.variant != "upstream":
        patch.install()  # before the timers below, so that they time ptdstream's methods
    save = {"s": 0.0}
    phases = PhasePeaks()
    lower = xnnpack_recipe.to_edge_transform_and_lower

    def lower_in_phase(*a, **kw):
        phases.enter("lower+emit")
        return lower(*a, **kw)

    xnnpack_recipe.to_edge_transform_and_lower = lower_in_phase

    def timed(name):
        real = getattr(ExecutorchProgramManager, name)

        def method(self, *a, **kw):
            phases.enter("save")
            t = time.perf_counter()
            try:
                return real(self, *a, **kw)
            finally:
                save["s"] += time.perf_counter() - t

        setattr(ExecutorchProgramManager, name, method)

    timed("write_to_file")
    timed("write_tensor_data_to_file")
    res = {"rss_after_imports": status_kib("VmRSS") * 1024, "anon_after_imports": status_kib("RssAnon") * 1024,
           "file_after_imports": status_kib("RssFile") * 1024}
    sampler = RssSampler(("VmRSS", "RssAnon", "RssFile"))
    reset_peak_rss()
    t = time.perf_counter()
    options = dict(task="text-generation", recipe="xnnpack", max_seq_len=MAX_SEQ_LEN)
    if args.variant == "ptdstream":
        managers = pt_optimum.run_main_export(args.model_dir, out, by_reference=True, **options)
    else:
        managers = main_export(args.model_dir, output_dir=out, **options)
    total = time.perf_counter() - t
    peaks = sampler.stop()
    res["phase_peak_rss"] = phases.stop()
    res["rss_at_lower"] = phases.start.get("lower+emit", 0)
    res["save_s"] = save["s"]
    res["export_s"] = total - save["s"]
    record_peaks(res, peaks)
    res["files"] = file_digests(out)
    if args.variant != "upstream":  # the same manager through executorch's own writer, after the measurement
        patch.uninstall()
        ref = os.path.join(args.out, args.variant + "-upstream-writer")
        os.makedirs(ref, exist_ok=True)
        for name, manager in managers.items():
            with open(os.path.join(ref, f"{name}.pte"), "wb") as f:
                ExecutorchProgramManager.write_to_file(manager, f)
            manager.write_tensor_data_to_file(ref)
        res["same_manager_identical"] = res["files"] == {
            os.path.basename(p): (os.path.getsize(p), xxh3_file(p)) for p in files_under(ref)}
        shutil.rmtree(ref)
    return res


def check_outputs(args) -> dict:
    """Runtime logits of each variant's model.pte on PROMPT, against upstream's and eager."""
    import torch
    import transformers
    from executorch.runtime import Runtime

    tokens = torch.tensor([PROMPT], dtype=torch.long)
    inputs = [tokens, torch.arange(len(PROMPT), dtype=torch.long)]
    runtime = Runtime.get()
    logits = {}
    for variant in args.variants:
        program = runtime.load_program(os.path.join(args.out, variant, "model.pte"))
        logits[variant] = program.load_method("forward").execute(inputs)[0]
        del program
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype="float32").eval()
    with torch.no_grad():
        want = model(tokens).logits
    res = {}
    for variant, got in logits.items():
        w = want if got.dim() == 3 else want[:, -1, :]
        res[variant] = {"equal_upstream": bool(torch.equal(got, logits["upstream"])),
                        "max_abs_diff_eager": float((got - w).abs().max())}
    return res


def run_child(args, mode: str, variant: str = "none") -> dict:
    result = os.path.join(args.out, "result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--variant", variant,
           "--layers", str(args.layers), "--out", args.out, "--result", result,
           "--variants", *args.variants]
    print(f"[{time.strftime('%H:%M:%S')}] {mode} {variant}", file=sys.stderr, flush=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL if args.quiet else None,
                   stderr=subprocess.DEVNULL if args.quiet else None)
    with open(result) as f:
        return json.load(f)


def after_lower(r: dict) -> int:
    """Bytes: the largest RSS from lowering on (lower, emit, save) over the RSS when lowering began."""
    return max(r["phase_peak_rss"]["lower+emit"], r["phase_peak_rss"]["save"]) - r["rss_at_lower"]


def table(model: dict, runs: dict, outputs: dict) -> str:
    w = model["weights_nbytes"]
    head = (f"{'model':<22} {'recipe':<7} {'variant':<9} {'export s':>8} {'save s':>7} {'peak+ GiB':>9} "
            f"{'x weights':>9} {'anon+ GiB':>9} {'file GiB':>8} {'identical':>9} {'same mgr':>8} {'outputs':>8}"
            f"   by phase, GiB: export peak+ | held at lower | lower+emit+save peak over it")
    lines = [f"weights: {model['params'] / 1e6:.0f} M parameters, {w / GiB:.2f} GiB fp32"
             " (safetensors, mapped by transformers)",
             head, "-" * len(head)]
    name = f"llama-{model['params'] / 1e6:.0f}M fp32"
    up = runs.get("upstream")
    verdicts = []
    for variant, r in runs.items():
        added = r["peak_rss"] - r["rss_after_imports"]
        anon = r["peak_anon"] - r["anon_after_imports"]
        same = "ref" if variant == "upstream" else ("yes" if up and r["files"] == up["files"] else "NO")
        mgr = {True: "yes", False: "NO"}.get(r.get("same_manager_identical"), "-")
        o = outputs.get(variant, {})
        ok = o.get("equal_upstream") and o.get("max_abs_diff_eager", 1.0) <= 1e-3
        lines.append(f"{name:<22} {'xnnpack':<7} {variant:<9} {r['export_s']:>8.1f} {r['save_s']:>7.2f} "
                     f"{added / GiB:>9.2f} {added / w:>9.2f} {anon / GiB:>9.2f} {r['peak_file'] / GiB:>8.2f} "
                     f"{same:>9} {mgr:>8} {'yes' if ok else 'NO':>8}   "
                     f"{(r['phase_peak_rss']['export'] - r['rss_after_imports']) / GiB:.2f} | "
                     f"{(r['rss_at_lower'] - r['rss_after_imports']) / GiB:.2f} | {after_lower(r) / GiB:.2f}")
        if variant != "upstream":
            verdicts.append((f"{variant}: same manager byte-identical through executorch's writer", mgr == "yes"))
        verdicts.append((f"{variant}: runtime logits equal upstream's and within 1e-3 of eager", bool(ok)))
        if variant == "ptdstream":
            verdicts.append(("ptdstream: lower+emit+save peak over the RSS held at lowering <= weights + 256 MiB",
                             after_lower(r) <= w + 256 * MiB))
            if up:
                verdicts.append(("ptdstream: lower+emit+save peak over the RSS held at lowering < upstream's",
                                 after_lower(r) < after_lower(up)))
    lines.append("")
    lines += [f"{'PASS' if ok else 'FAIL'} {what}" for what, ok in verdicts]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=20, help="decoder layers (20: ~290 M parameters)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--out", default="./bench-hf-out", help="scratch folder (removed at the end)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quiet", action="store_true", help="hide the children's output (warnings, progress)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.model_dir = os.path.join(args.out, "model")
    if args.child:
        fn = {"prepare": prepare, "export": child, "outputs": check_outputs}[args.child]
        with open(args.result, "w") as f:
            json.dump(fn(args), f)
        return 0
    if "upstream" not in args.variants:
        args.variants.insert(0, "upstream")
    os.makedirs(args.out, exist_ok=True)
    try:
        model = run_child(args, "prepare")
        runs = {v: run_child(args, "export", v) for v in args.variants}
        outputs = run_child(args, "outputs")
    finally:
        shutil.rmtree(args.out, ignore_errors=True)
    text = table(model, runs, outputs)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "runs": runs, "outputs": outputs}, f, indent=2)
    return 1 if "\nFAIL " in text else 0


if __name__ == "__main__":
    raise SystemExit(main())
