#!/usr/bin/env python
"""Time to the answer: how long a command line takes to refuse what it can refuse at once.

Each case is a mistake a user makes on the first day (a missing file, an output that
exists, an option the route refuses); each runs as a fresh process (``python -m
ptdstream ...`` or ``python -m ptdstream.hf ...``) and is timed from start to exit.
With ``--base TREE`` every case also runs with another checkout's package
(``PYTHONPATH=TREE``, the same interpreter and packages), side by side in the same
run, and the ratio base / this is printed; ``python -c pass`` is the floor of any
Python command. Rows also say whether torch was imported (``-X importtime``) and
check the answer (exit code and the start of its one line) so that a faster wrong
answer does not count. The Hugging Face folder holds only ``config.json``: a tree
that does not refuse the existing output starts the export, which fails when it
finds no weights (its row shows that answer and its time).

Usage:
    python benchmarks/bench_answers.py                        # this tree, 5 runs
    python benchmarks/bench_answers.py --base /work/main      # before/after, one run

Inputs (made once, not timed): a small program with external weights and its
checkpoint (torch), an existing output for each command, and a folder with a
``config.json`` for the Hugging Face cases. Exit status: 0 when every answer of this
tree was the expected one, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from _measure import median  # noqa: E402 - after the sys.path entries that find it

#: (name, argv after python, expected exit code, expected start of stderr)
CASES = [
    ("verify of a missing file", ["-m", "ptdstream", "verify", "absent.pte"], 2, "ptdstream: cannot read absent.pte"),
    ("inspect of a missing file", ["-m", "ptdstream", "inspect", "absent.ptd"], 2, "ptdstream: cannot read absent"),
    ("pack of a missing file", ["-m", "ptdstream", "pack", "absent.ptd"], 2, "ptdstream: cannot read absent.ptd"),
    ("weights, output exists", ["-m", "ptdstream", "weights", "model.pte", "--from", "ck.safetensors", "-o", "new"],
     2, "ptdstream weights: error: output new/_default_external_constant.ptd exists"),
    ("hf --weightless --qlinear", ["-m", "ptdstream.hf", "export", "executorch", "-m", "my-llama", "--recipe",
                                   "xnnpack", "-o", "hf-new", "--weightless", "--qlinear", "8da4w"],
     1, "ptdstream.hf: error: my-llama: --qlinear '8da4w'"),
    ("hf, output holds an export", ["-m", "ptdstream.hf", "export", "executorch", "-m", "my-llama", "--recipe",
                                    "xnnpack", "-o", "hf-out"], 2, "ptdstream.hf: error: -o hf-out holds model.pte"),
    ("python -c pass", ["-c", "pass"], 0, ""),
]

def _inputs(folder: str) -> None:
    """The program, its checkpoint, the existing outputs and the Hugging Face folder."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from conftest import Mlp, export
    from executorch.exir import ExecutorchBackendConfig
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = Mlp()
    manager = export(model, config=ExecutorchBackendConfig(external_constants=True))
    with open(os.path.join(folder, "model.pte"), "wb") as f:
        manager.write_to_file(f)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
              os.path.join(folder, "ck.safetensors"))
    os.makedirs(os.path.join(folder, "new"))
    manager.write_tensor_data_to_file(os.path.join(folder, "new"))
    os.makedirs(os.path.join(folder, "my-llama"))
    with open(os.path.join(folder, "my-llama", "config.json"), "w") as f:
        f.write("{}")
    os.makedirs(os.path.join(folder, "hf-out"))
    with open(os.path.join(folder, "hf-out", "model.pte"), "wb") as f:
        f.write(b"an earlier export")


def _run(tree: str, argv: list[str], folder: str) -> tuple[float, int, str, bool]:
    """Seconds, exit code, stderr without the importtime lines, whether torch was imported."""
    env = dict(os.environ, PYTHONPATH=tree, HF_HUB_OFFLINE="1", PTDSTREAM_DEBUG="1")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=folder, capture_output=True, text=True,
                          env=env, timeout=3600)
    seconds = time.perf_counter() - start
    lines = proc.stderr.splitlines()
    torch = any(line.rsplit("|", 1)[-1].strip() == "torch" for line in lines if line.startswith("import time:"))
    err = "\n".join(line for line in lines if not line.startswith("import time:"))
    return seconds, proc.returncode, err, torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="another checkout to time side by side (PYTHONPATH=BASE)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per case and tree (default 5)")
    args = parser.parse_args(argv)
    trees = [("this", ROOT)] + ([("base", os.path.abspath(args.base))] if args.base else [])
    folder = tempfile.mkdtemp(prefix="bench-answers-")
    ok = True
    try:
        _inputs(folder)
        print(f"{'case':<30} {'tree':<5} {'median s':>9} {'min s':>7} {'torch':>6}  answer")
        for name, case, code, start in CASES:
            medians = {}
            for label, tree in trees:
                runs = [_run(tree, case, folder) for _ in range(args.runs + 1)][1:]  # one warm-up
                seconds = [r[0] for r in runs]
                _, rc, err, torch = runs[-1]
                right = rc == code and err.startswith(start)
                ok = ok and (right or label == "base")
                medians[label] = median(seconds)
                answer = (err.splitlines() or [""])[0][:70] if right else f"exit {rc}: {err[-70:]!r}"
                print(f"{name:<30} {label:<5} {median(seconds):>9.2f} {min(seconds):>7.2f} "
                      f"{'yes' if torch else 'no':>6}  {answer}", flush=True)
            if "base" in medians:
                print(f"{'':<30} base / this: {medians['base'] / medians['this']:.1f}x", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
