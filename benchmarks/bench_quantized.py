"""A quantized Hugging Face export, side by side: optimum's CLI, ptdstream's save of the
loaded model, and the streaming (``--weightless``) route; peak RSS added and wall time.

    python benchmarks/bench_quantized.py --gib 0.25 --out /tmp/bench-q                  # a small size, ~10 min
    python benchmarks/bench_quantized.py --json bench-quantized.json                    # 1 and 4 GiB (default)
    python benchmarks/bench_quantized.py --layers 2 --check --out /tmp/bench-q          # verify + runtime logits
    python benchmarks/bench_quantized.py --shape llama3-8b --routes streaming --keep-checkpoint /big/ckpt
    python benchmarks/bench_quantized.py --shape tiny --layers 2 --check                # seconds: a smoke test

The model is a ``transformers.LlamaForCausalLM`` (untied head, head dim 128) whose
random checkpoint is written by a first process as ``save_pretrained`` lays it out
(``config.json``, ``generation_config.json``, ``model-0000i-of-0000N.safetensors``
with metadata ``{"format": "pt"}``, ``model.safetensors.index.json``; bf16), one
shard at a time, so that writing it never holds the model (8B included): each
shard's tensors are made (``randn`` from a seed per tensor, times 0.02; norms
ones), written and freed. Shapes (``--shape``):

* ``issue`` (default): hidden 1536, MLP 4096, vocab 32000, 12 heads, 4 KV heads,
  as many layers as bring the bf16 weights nearest each ``--gib`` size (16 layers
  = 0.93 GiB: issue 33's measurement);
* ``llama3-8b``: hidden 4096, 32 layers, MLP 14336, 32 heads, 8 KV heads, vocab
  128256 (14.96 GiB bf16);
* ``tiny``: hidden 256, MLP 512, vocab 32000, 2 heads, 1 KV head (development).

``--layers`` replaces the layer count (``--gib`` is then ignored); ``--hidden``,
``--intermediate``, ``--vocab``, ``--heads``, ``--kv-heads`` replace the shape's.
A kept checkpoint (``--keep-checkpoint``) is reused when complete.

Routes, each in a fresh Python process (``--routes`` picks them; a route not picked
is listed as skipped, with the reason), all with the same export options
(``export executorch --task text-generation --recipe xnnpack --qlinear Q
--qembedding E`` [``--max_seq_len N``]; fp32, optimum's default dtype):

* ``upstream``: ``optimum-cli`` (``optimum.commands.optimum_cli.main``, in-process);
* ``loaded``: ``python -m ptdstream.hf`` (``ptdstream.hf.cli.main``): the model
  loaded as upstream loads it, saved by ptdstream;
* ``streaming``: the same with ``--weightless``.

Every child imports the same modules (torch, transformers, torchao, executorch
and its XNNPACK backend, optimum's CLI and exporters, ptdstream.hf), then the
measurement starts: peak RSS added is the larger of ``VmHWM`` (reset after the
imports) and a 5 ms ``VmRSS`` sampler, over the RSS after the imports; wall s is the
export (load, quantize, export, lower, save), not the imports; CPU s is the
child's user + system time over the same span. ``identical``: sha256 of every file
the route wrote equals upstream's (``ref`` on upstream; ``n/a`` where upstream did
not run). ``x upstream``: the route's figure over upstream's.

``upstream`` and ``loaded`` hold the fp32 model (4 bytes a parameter, twice the
bf16 checkpoint); issue 33 measured optimum's CLI at 3.9x the checkpoint. Either
is skipped, with the reason, when that estimate is above ``MemAvailable``
(``--no-skip`` runs it anyway).

``--check`` keeps each route's files and checks them: ``python -m ptdstream verify``
on every ``.pte`` (its last line), then one process loads each ``model.pte`` with
the ExecuTorch runtime (``executorch.runtime``), loads and runs every method (the
metadata methods without inputs, ``forward`` on a 5-token prompt with its cache
positions) and compares ``forward``'s logits with the eager quantized model's
(optimum's ``load_causal_lm_model`` with the same options, wrapped in
transformers' ``TorchExportableModuleForDecoderOnlyLM``, as the export traces it):
``torch.equal``, else the largest absolute difference. The eager model is fp32
and whole: use it at a small size (``--layers 2``).

Targets (issue 33), PASS/FAIL under each table: the streaming route adds at most
1 GiB, its files' sha256 equal upstream's, it is no slower than upstream (5%
allowed); with two sizes or more, its peaks are within 128 MiB of each other.

Under each table, one line per ptdstream route: its peak RSS added during each stage
it announced on stderr (``[2] torch.export 1 (...) ...``; named by the first word:
``load`` includes the streamed quantization), total and anonymous part (GiB), so
that the stage deciding the peak is read off the run itself.

Exit status: 0 every route that ran succeeded and every target and check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import RssSampler, discard_file, files_under, loadavg1, record_peaks, reset_peak_rss, status_kib

GiB = 1 << 30
MiB = 1 << 20
HEAD_DIM = 128
ROUTES = ("upstream", "loaded", "streaming")
SHAPES = {
    "issue": {"hidden": 1536, "intermediate": 4096, "vocab": 32000, "heads": 12, "kv_heads": 4, "layers": None},
    "llama3-8b": {"hidden": 4096, "intermediate": 14336, "vocab": 128256, "heads": 32, "kv_heads": 8, "layers": 32},
    "tiny": {"hidden": 256, "intermediate": 512, "vocab": 32000, "heads": 2, "kv_heads": 1, "layers": None},
}
#: optimum-cli's peak added over the bf16 checkpoint's bytes (issue 33: 3.63 GiB at 0.93 GiB).
LOADED_PEAK_PER_CHECKPOINT_BYTE = 3.9
PROMPT = [1, 306, 4966, 29871, 13]
DONE = ".complete"  # written last: a folder without it is rebuilt
PIECE_NBYTES = 8 * MiB
#: issue 33's targets for the streaming route: peak added, and its spread between sizes.
TARGET_NBYTES = 1 * GiB
FLAT_NBYTES = 128 * MiB
#: A stage line of ptdstream's export as it begins (``[3] torch.export 1 (Module) ...``): group 1 its words.
STAGE_LINE = re.compile(r"^\[\d+(?:/\d+)?\] (.+?) \.\.\.$")


def stage_name(words: str) -> str:
    """A stage's name in the table: its first word (``torch.export 2 (Module)``,
    ``load /x/y (...)``, ``lower and emit program 'model'``: ``torch.export``, ``load``, ``lower``)."""
    return words.split()[0]


# ---------------------------------------------------------------- the checkpoint


def config(shape: dict):
    import transformers

    return transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"], vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], head_dim=HEAD_DIM,
        tie_word_embeddings=False, dtype="bfloat16")


def parameters(shape: dict) -> int:
    """The model's parameter count (untied head, no biases, head dim 128)."""
    h, i, v = shape["hidden"], shape["intermediate"], shape["vocab"]
    q, kv = shape["heads"] * HEAD_DIM, shape["kv_heads"] * HEAD_DIM
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
    return shape["layers"] * per_layer + 2 * v * h + h


def layers_for(gib: float, shape: dict) -> int:
    """Layers that bring the bf16 weights nearest ``gib`` GiB (at least 1)."""
    one = parameters(dict(shape, layers=1))
    base = parameters(dict(shape, layers=0))
    return max(1, round((gib * GiB / 2 - base) / (one - base)))


def folder_name(shape: dict) -> str:
    return (f"llama-h{shape['hidden']}-i{shape['intermediate']}-v{shape['vocab']}-a{shape['heads']}"
            f"-kv{shape['kv_heads']}-l{shape['layers']}-bf16")


def write_checkpoint(shape: dict, folder: str, max_shard_size: str) -> dict:
    """Write ``folder`` as ``save_pretrained`` lays it out, one shard in memory at a time
    (unless it is complete already); returns its parameter count and bytes."""
    import huggingface_hub
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg = config(shape)
    with torch.device("meta"):
        layout = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).state_dict()
    nbytes = sum(t.numel() * 2 for t in layout.values())
    res = {"params": sum(t.numel() for t in layout.values()), "weights_nbytes": nbytes}
    if os.path.exists(os.path.join(folder, DONE)):
        return res
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    split = huggingface_hub.split_torch_state_dict_into_shards(
        layout, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    seeds = {key: i for i, key in enumerate(layout)}
    for filename, keys in split.filename_to_tensors.items():
        shard = {}
        for key in keys:
            if key.endswith("norm.weight"):
                shard[key] = torch.ones(layout[key].shape, dtype=torch.bfloat16)
            else:
                g = torch.Generator().manual_seed(seeds[key])
                shard[key] = (torch.randn(layout[key].shape, generator=g) * 0.02).to(torch.bfloat16)
        save_file(shard, os.path.join(folder, filename), metadata={"format": "pt"})
        del shard
    if split.is_sharded:
        index = {"metadata": {"total_parameters": res["params"], "total_size": nbytes},
                 "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    cfg.save_pretrained(folder)
    transformers.GenerationConfig.from_model_config(cfg).save_pretrained(folder)
    with open(os.path.join(folder, DONE), "w") as f:
        f.write("ok\n")
    return res


# ---------------------------------------------------------------- one route in a child


def export_argv(args, out: str) -> list[str]:
    argv = ["export", "executorch", "--model", args.folder, "--task", "text-generation", "--recipe", "xnnpack",
            "--output_dir", out]
    argv += ["--qlinear", args.qlinear] * bool(args.qlinear) + ["--qembedding", args.qembedding] * bool(args.qembedding)
    return argv + ["--max_seq_len", str(args.max_seq_len)] * bool(args.max_seq_len)


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(PIECE_NBYTES):
            digest.update(piece)
    return digest.hexdigest()


class StageTap:
    """A text stream in front of ``stream`` that marks ``sampler``'s stage at each stage
    line ptdstream prints (``[3] torch.export 1 (...) ...``: :class:`ptdstream.progress.Stages`)."""

    def __init__(self, stream, sampler) -> None:
        self.stream, self.sampler, self._line = stream, sampler, ""

    def write(self, text: str) -> int:
        self._line += text
        *lines, self._line = self._line.split("\n")
        for line in lines:
            match = STAGE_LINE.match(line)
            if match:
                self.sampler.mark(stage_name(match.group(1)))
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def child(args) -> dict:
    """One route, measured from the end of its imports; returns its figures."""
    # The same imports in every route, before the baseline (their cost is not the export's).
    import executorch.backends.xnnpack.partition.xnnpack_partitioner
    import executorch.exir  # noqa: F401 - import cost only
    import optimum.exporters.executorch
    import optimum.exporters.executorch.quantization
    import optimum.exporters.executorch.tasks.causal_lm  # noqa: F401 - import cost only
    import torch  # noqa: F401 - import cost only
    import torchao.quantization.quant_api  # noqa: F401 - import cost only
    import transformers  # noqa: F401 - import cost only
    from optimum.commands.optimum_cli import main as optimum_cli_main

    import ptdstream.hf.cli
    import ptdstream.hf.saving
    import ptdstream.weightless.hf

    out = os.path.join(args.out, args.route)
    os.makedirs(out, exist_ok=True)
    argv = export_argv(args, out)
    res = {"rss_after_imports": status_kib("VmRSS") * 1024, "anon_after_imports": status_kib("RssAnon") * 1024,
           "load_start": loadavg1()}
    reset_peak_rss()
    sampler = RssSampler(("VmRSS", "RssAnon", "RssFile"))
    sampler.mark("start")
    real_stderr, sys.stderr = sys.stderr, StageTap(sys.stderr, sampler)
    cpu0, t0 = os.times(), time.perf_counter()
    try:
        if args.route == "upstream":
            saved, sys.argv = sys.argv, ["optimum-cli", *argv]
            try:
                optimum_cli_main()
                rc = 0
            except SystemExit as e:  # argparse's exit on a bad line
                rc = e.code if isinstance(e.code, int) else 1
            finally:
                sys.argv = saved
        else:
            rc = ptdstream.hf.cli.main(argv + ["--weightless"] * (args.route == "streaming"))
    finally:
        res["wall_s"] = time.perf_counter() - t0
        cpu1 = os.times()
        res["cpu_s"] = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        sys.stderr = real_stderr
        record_peaks(res, sampler.stop())
        res["stages"] = {name: [peaks["VmRSS"] - res["rss_after_imports"], peaks["RssAnon"] - res["anon_after_imports"]]
                         for name, peaks in sampler.stages.items()}
        res["load_end"] = loadavg1()
    res["rc"] = rc
    res["files"] = {os.path.relpath(p, out): [os.path.getsize(p), sha256_file(p)] for p in files_under(out)}
    return res


def run_child(args, route: str) -> dict:
    """``route`` in a fresh process; its stderr passed through, its last lines kept."""
    result = os.path.join(args.out, f"{route}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", route, "--folder", args.folder, "--out", args.out,
           "--result", result, "--qlinear", args.qlinear, "--qembedding", args.qembedding,
           "--max-seq-len", str(args.max_seq_len or 0)]
    print(f"[{time.strftime('%H:%M:%S')}] {route} (load average {loadavg1():.2f})", file=sys.stderr, flush=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    tail: list[str] = []
    with subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace") as proc:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            tail = (tail + [line.rstrip()])[-20:]
    if proc.returncode != 0 or not os.path.exists(result):
        return {"rc": proc.returncode, "error": _reason(tail) or f"exit status {proc.returncode}"}
    with open(result) as f:
        res = json.load(f)
    if res["rc"] != 0:
        res["error"] = _reason(tail) or f"exit status {res['rc']}"
    return res


def _reason(tail: list[str]) -> str:
    """The last error-like line of a route's stderr (a refusal, an exception)."""
    for line in reversed(tail):
        if "error" in line.lower() or line.startswith(("Traceback", "Exception")) or "Error:" in line:
            return line.strip()
    return tail[-1].strip() if tail else ""


# ---------------------------------------------------------------- the check (--check)


def check_child(args) -> dict:
    """Runtime of each route's ``model.pte``: every method loaded and run; ``forward``'s
    logits against the eager quantized model's."""
    import executorch.kernels.quantized  # noqa: F401 - the runtime's quantized_decomposed kernels (embedding_byte)
    import torch
    from executorch.runtime import Runtime
    from optimum.exporters.executorch.tasks.causal_lm import load_causal_lm_model
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    tokens = torch.tensor([PROMPT], dtype=torch.long)
    positions = torch.arange(len(PROMPT), dtype=torch.long)
    options = {k: v for k, v in (("qlinear", args.qlinear), ("qembedding", args.qembedding),
                                 ("max_seq_len", args.max_seq_len)) if v}
    exportable = load_causal_lm_model(args.folder, **options)
    with torch.no_grad():
        want = TorchExportableModuleForDecoderOnlyLM(exportable.model)(input_ids=tokens, cache_position=positions)
    del exportable
    runtime = Runtime.get()
    res: dict = {}
    logits: dict = {}
    for route in args.check_routes:
        program = runtime.load_program(os.path.join(args.out, route, "model.pte"))
        names = sorted(program.method_names)
        ran, got = [], None
        for name in names:
            method = program.load_method(name)
            outputs = method.execute([tokens, positions] if name == "forward" else [])
            ran.append(name)
            if name == "forward":
                got = outputs[0]
        r = {"methods": names, "ran": ran}
        if got is None:
            r["logits"] = "no forward method"
        elif got.shape != want.shape:
            r["logits"] = f"shape {tuple(got.shape)} vs eager {tuple(want.shape)}"
        else:
            r["equal"] = bool(torch.equal(got, want))
            r["max_abs_diff"] = float((got - want).abs().max())
            r["max_abs_eager"] = float(want.abs().max())
            r["argmax_equal"] = bool(torch.equal(got.argmax(-1), want.argmax(-1)))
        res[route] = r
        logits[route] = got
        del program
    for route, got in logits.items():
        up = logits.get("upstream")
        if route != "upstream" and up is not None and got is not None:
            res[route]["equal_upstream"] = bool(torch.equal(got, up))
    return res


def verify(path: str) -> tuple[int, str]:
    """``python -m ptdstream verify PATH``: exit status and its verdict (its ``OK``/``FAIL`` line, the
    number of checks passed and every line that is not ``ok``)."""
    proc = subprocess.run([sys.executable, "-m", "ptdstream", "verify", path], capture_output=True, text=True)
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    passed = sum(line.startswith("ok ") for line in lines)
    verdict = [line for line in lines if not line.startswith("ok ") and not line.startswith("ptdstream verify: ")]
    return proc.returncode, f"{' | '.join(verdict) or '(no verdict)'} ({passed} checks ok)"


def check(args, routes: list[str]) -> dict:
    """``--check``: ``ptdstream verify`` on each route's .pte files, then the runtime (one process)."""
    res: dict = {r: {"verify": {}} for r in routes}
    for route in routes:
        for path in files_under(os.path.join(args.out, route)):
            if path.endswith(".pte"):
                rc, line = verify(path)
                res[route]["verify"][os.path.basename(path)] = {"rc": rc, "line": line}
    result = os.path.join(args.out, "check.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "check", "--folder", args.folder, "--out", args.out,
           "--result", result, "--qlinear", args.qlinear, "--qembedding", args.qembedding,
           "--max-seq-len", str(args.max_seq_len or 0), "--check-routes", *routes]
    print(f"[{time.strftime('%H:%M:%S')}] check: runtime and eager logits", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    if proc.returncode == 0:
        with open(result) as f:
            for route, r in json.load(f).items():
                res[route]["runtime"] = r
    else:
        for route in routes:
            res[route]["runtime"] = {"logits": f"check process failed (exit status {proc.returncode})"}
    return res


# ---------------------------------------------------------------- the table


def added(r: dict) -> int:
    return r["peak_rss"] - r["rss_after_imports"]


def table(runs: dict, skipped: dict) -> str:
    head = (f"{'route':<10} {'peak+ GiB':>9} {'anon+ GiB':>9} {'wall s':>7} {'CPU s':>7} {'identical':>9} "
            f"{'x up peak':>9} {'x up wall':>9} {'load avg':>9}  files")
    lines = [head, "-" * len(head)]
    up = runs.get("upstream")
    up_ok = up is not None and up.get("rc") == 0
    for route in ROUTES:
        if route in skipped:
            lines.append(f"{route:<10} skipped: {skipped[route]}")
            continue
        if route not in runs:
            continue
        r = runs[route]
        if r.get("rc") != 0:
            lines.append(f"{route:<10} FAILED: {r.get('error', '')}")
            continue
        same = "ref" if route == "upstream" else ("n/a" if not up_ok else ("yes" if r["files"] == up["files"]
                                                                            else "NO"))
        ratio_peak = f"{added(r) / added(up):.2f}" if up_ok and added(up) else "-"
        ratio_wall = f"{r['wall_s'] / up['wall_s']:.2f}" if up_ok else "-"
        files = ", ".join(f"{name} {size / 1e6:.1f} MB" for name, (size, _) in sorted(r["files"].items()))
        lines.append(f"{route:<10} {added(r) / GiB:>9.2f} {(r['peak_anon'] - r['anon_after_imports']) / GiB:>9.2f} "
                     f"{r['wall_s']:>7.1f} {r['cpu_s']:>7.1f} {same:>9} {ratio_peak:>9} {ratio_wall:>9} "
                     f"{r['load_start']:>4.1f}-{r['load_end']:<4.1f}  {files}")
    return "\n".join(lines)


def stage_lines(runs: dict) -> list[str]:
    """Each ptdstream route's peak RSS added per stage (GiB, anonymous part after the slash)."""
    lines = []
    for route in ROUTES:
        stages = runs.get(route, {}).get("stages") or {}
        named = {k: v for k, v in stages.items() if k != "start"}
        if named and runs[route].get("rc") == 0:
            lines.append(f"{route} stages, peak+ / anon+ GiB: " + ", ".join(
                f"{name} {rss / GiB:.2f}/{anon / GiB:.2f}" for name, (rss, anon) in named.items()))
    return lines


def verdicts(runs: dict) -> list[str]:
    """Issue 33's targets for the streaming route at one size: PASS/FAIL lines."""
    r, up = runs.get("streaming"), runs.get("upstream")
    if r is None or r.get("rc") != 0:
        return []
    lines = [f"{'PASS' if added(r) <= TARGET_NBYTES else 'FAIL'} streaming: peak added <= "
             f"{TARGET_NBYTES / GiB:.0f} GiB ({added(r) / GiB:.2f})"]
    if up is not None and up.get("rc") == 0:
        lines.append(f"{'PASS' if r['files'] == up['files'] else 'FAIL'} streaming: sha256 of every file equal to "
                     "upstream's")
        lines.append(f"{'PASS' if r['wall_s'] <= 1.05 * up['wall_s'] else 'FAIL'} streaming: no slower than upstream "
                     f"({r['wall_s']:.1f} vs {up['wall_s']:.1f} s, 5% allowed)")
    return lines


def flat_verdict(report: dict) -> list[str]:
    """The streaming route's peaks at two sizes or more: within FLAT_NBYTES."""
    peaks = [added(e["runs"]["streaming"]) for e in report.values() if e["runs"].get("streaming", {}).get("rc") == 0]
    if len(peaks) < 2:
        return []
    spread = max(peaks) - min(peaks)
    return [f"{'PASS' if spread <= FLAT_NBYTES else 'FAIL'} streaming: flat in size (peaks within "
            f"{FLAT_NBYTES // MiB} MiB: spread {spread / MiB:.0f} MiB)"]


def check_lines(checked: dict) -> list[str]:
    lines = []
    for route, c in checked.items():
        for name, v in c["verify"].items():
            lines.append(f"{'PASS' if v['rc'] == 0 else 'FAIL'} {route}: ptdstream verify {name}: {v['line']}")
        rt = c.get("runtime", {})
        if "methods" in rt:
            lines.append(f"{'PASS' if rt['ran'] == rt['methods'] else 'FAIL'} {route}: runtime loaded and ran "
                         f"{len(rt['ran'])}/{len(rt['methods'])} methods ({', '.join(rt['methods'])})")
        if "equal" in rt:
            lines.append(f"{'PASS' if rt['equal'] else 'DIFF'} {route}: forward logits vs the eager quantized model: "
                         f"torch.equal {rt['equal']}, max abs diff {rt['max_abs_diff']:.3g} "
                         f"(largest eager logit {rt['max_abs_eager']:.3g}), argmax equal {rt['argmax_equal']}")
        if "equal_upstream" in rt:
            lines.append(f"{'PASS' if rt['equal_upstream'] else 'FAIL'} {route}: runtime logits torch.equal to "
                         f"upstream's .pte's: {rt['equal_upstream']}")
        if "logits" in rt:
            lines.append(f"FAIL {route}: {rt['logits']}")
    return lines


# ---------------------------------------------------------------- main


def shape_of(args, gib: float | None) -> dict:
    shape = dict(SHAPES[args.shape])
    for key in ("hidden", "intermediate", "vocab", "heads", "kv_heads"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    shape["layers"] = args.layers or shape["layers"] or layers_for(gib or 1.0, shape)
    return shape


def skip_reasons(args, weights_nbytes: int) -> dict[str, str]:
    skipped = {r: "not in --routes" for r in ROUTES if r not in args.routes}
    need = LOADED_PEAK_PER_CHECKPOINT_BYTE * weights_nbytes
    available = status_kib("MemAvailable", "/proc/meminfo") * 1024
    if not args.no_skip and need > available:
        for route in ("upstream", "loaded"):
            skipped.setdefault(route, f"holds the fp32 model: about {need / GiB:.1f} GiB added "
                                      f"({LOADED_PEAK_PER_CHECKPOINT_BYTE}x the bf16 checkpoint, issue 33), "
                                      f"MemAvailable {available / GiB:.1f} GiB (--no-skip runs it anyway)")
    return skipped


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0],
                   help="bf16 weight sizes (GiB), each a run of every route (ignored with --layers or llama3-8b)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="issue")
    p.add_argument("--layers", type=int, help="the model's layers (instead of --gib)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES),
                   help="the routes to run, in this order (the table keeps upstream, loaded, streaming)")
    p.add_argument("--no-skip", action="store_true", help="run upstream and loaded even when they look too large")
    p.add_argument("--qlinear", default="8da4w", help="optimum's --qlinear ('' for none)")
    p.add_argument("--qembedding", default="8w", help="optimum's --qembedding ('' for none)")
    p.add_argument("--max-seq-len", type=int, default=0, help="optimum's --max_seq_len (0: not passed, 2048)")
    p.add_argument("--max-shard-size", default="200MB", help="the checkpoint's shards (save_pretrained's option)")
    p.add_argument("--out", default="./bench-quantized-out", help="scratch folder (removed at the end)")
    p.add_argument("--keep-checkpoint", metavar="PATH",
                   help="keep each size's checkpoint under PATH and reuse it when there (default: in --out)")
    p.add_argument("--check", action="store_true",
                   help="ptdstream verify, the runtime's methods and logits vs the eager quantized model")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--check-routes", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.route = args.child
        if args.child == "prepare":
            res = write_checkpoint(json.loads(args.folder), args.out, args.max_shard_size)
        elif args.child == "check":
            res = check_child(args)
        else:
            res = child(args)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return 0
    os.makedirs(args.out, exist_ok=True)
    report: dict = {}
    texts, failed = [], False
    sizes = [None] if args.layers or SHAPES[args.shape]["layers"] else args.gib
    try:
        for gib in sizes:
            shape = shape_of(args, gib)
            args.folder = os.path.join(args.keep_checkpoint or args.out, folder_name(shape))
            print(f"[{time.strftime('%H:%M:%S')}] checkpoint {args.folder}", file=sys.stderr, flush=True)
            result = os.path.join(args.out, "prepare.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "prepare", "--folder",
                            json.dumps(shape), "--out", args.folder, "--result", result,
                            "--max-shard-size", args.max_shard_size], check=True)
            with open(result) as f:
                model = json.load(f)
            shards = sum(1 for n in os.listdir(args.folder) if n.endswith(".safetensors"))
            label = (f"llama {shape['layers']} layers (hidden {shape['hidden']}, MLP {shape['intermediate']}, "
                     f"vocab {shape['vocab']}, {shape['heads']}/{shape['kv_heads']} heads), "
                     f"{model['params'] / 1e6:.0f} M parameters, {model['weights_nbytes'] / GiB:.2f} GiB bf16 "
                     f"in {shards} shard(s); --qlinear {args.qlinear or '-'} --qembedding {args.qembedding or '-'}"
                     f" --max_seq_len {args.max_seq_len or 'default'}")
            skipped = skip_reasons(args, model["weights_nbytes"])
            runs: dict = {}
            for route in args.routes:  # in the order given
                if route in skipped:
                    continue
                runs[route] = run_child(args, route)
                failed |= runs[route].get("rc") != 0
                if not args.check:
                    for path in files_under(os.path.join(args.out, route)):
                        discard_file(path)
                print(table(runs, skipped), file=sys.stderr, flush=True)
            text = "\n".join([label, table(runs, skipped), *stage_lines(runs), "", *verdicts(runs)])
            entry = {"shape": shape, "model": model, "runs": runs, "skipped": skipped}
            if args.check:
                ran = [r for r in runs if runs[r].get("rc") == 0]
                if ran:
                    entry["check"] = check(args, ran)
                    lines = check_lines(entry["check"])
                    failed |= any(line.startswith("FAIL") for line in lines)
                    text += "\n\n" + "\n".join(lines)
            for route in ROUTES:
                shutil.rmtree(os.path.join(args.out, route), ignore_errors=True)
            report[label] = entry
            texts.append(text)
    finally:
        shutil.rmtree(args.out, ignore_errors=True)
    text = "\n\n".join(texts + flat_verdict(report))
    failed |= "FAIL " in text
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
