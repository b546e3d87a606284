"""Claim 7 (outputs that are also inputs): `ptdstream weights` into a folder where
an output name is also a file being read.

  1. the checkpoint (--from) is OUT/_default_external_constant.ptd (a weights-only
     torch.save file): the output name of the default tag;
  2. the --like .ptd is OUT/_default_external_constant.ptd.

Expected (the CLI's rule, ptdstream/system/files.py refuse_overwrite: "Refuse,
before anything is written, an output that is one of the inputs (always)"):
exit 2, one line naming the file ("output ... is also an input"), the folder
unchanged byte for byte.
Actual: exit 0; the input is replaced by the output (case 1: the only copy of
the checkpoint is gone). The .ptd written is complete (not torn): it equals the
one written into a fresh folder.

usage: PYTHONPATH=. python tools/repro2/weights_output_is_input.py
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests"))

import safetensors.torch as st  # noqa: E402
import torch  # noqa: E402
from conftest import Mlp, export, reference_files  # noqa: E402
from executorch.exir import ExecutorchBackendConfig  # noqa: E402

PTD = "_default_external_constant.ptd"


def cli(*args):
    r = subprocess.run([sys.executable, "-m", "ptdstream", *args], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=REPO))
    return r.returncode, (r.stdout + r.stderr).strip().splitlines()[-1:]


def snap(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def main() -> int:
    root = tempfile.mkdtemp(prefix="b2io-")
    bad = 0
    try:
        torch.manual_seed(0)
        m = Mlp()
        reference_files(export(m, config=ExecutorchBackendConfig(external_constants=True)), os.path.join(root, "exp"))
        new = {k: v.detach().contiguous() + 1 for k, v in m.state_dict().items()}
        st.save_file(new, os.path.join(root, "new.safetensors"))
        fresh = os.path.join(root, "fresh")
        os.makedirs(fresh)
        assert cli("weights", os.path.join(root, "exp", "model.pte"), "--from", os.path.join(root, "new.safetensors"),
                   "-o", fresh)[0] == 0
        want = open(os.path.join(fresh, PTD), "rb").read()

        out = os.path.join(root, "c1")
        os.makedirs(out)
        shutil.copy(os.path.join(root, "exp", "model.pte"), out)
        torch.save(new, os.path.join(out, PTD))
        before = snap(out)
        rc, last = cli("weights", os.path.join(out, "model.pte"), "--from", os.path.join(out, PTD), "-o", out)
        after = snap(out)
        print(f"1. --from OUT/{PTD}: exit {rc} {last}; folder unchanged: {after == before}; "
              f"checkpoint still there: {after.get(PTD) == before[PTD]}; output complete: {after.get(PTD) == want}")
        bad += rc != 2 or after != before

        out = os.path.join(root, "c2")
        shutil.copytree(os.path.join(root, "exp"), out)
        before = snap(out)
        rc, last = cli("weights", os.path.join(out, "model.pte"), "--from", os.path.join(root, "new.safetensors"),
                       "--like", os.path.join(out, PTD), "-o", out)
        after = snap(out)
        print(f"2. --like OUT/{PTD}: exit {rc} {last}; folder unchanged: {after == before}; "
              f"output complete: {after.get(PTD) == want}")
        bad += rc != 2 or after != before
        print("expected: exit 2 naming the file as also an input, folder unchanged")
        print(f"actual: {bad} of 2 cases overwrote the input" if bad else "actual: as expected")
        return 1 if bad else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
