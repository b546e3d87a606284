"""Claim 4: standard output open on an input is refused ("by every command").

`ptdstream weights` lists only the program and --like files as inputs
(ptdstream/cli/cmd_weights.py:43), not --from / --old: its report on stdout is
appended to the checkpoint it reads.

    ptdstream weights model.pte --from ck.safetensors -o out/ >> ck.safetensors

Expected: exit 2, "standard output is the input ck.safetensors", checkpoint unchanged.
Actual:   exit 0, the report line appended to ck.safetensors.

Run: PYTHONPATH=. python tools/repro/weights_stdout_on_checkpoint.py   (exit 1 = bug present)
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import make_set, run_cli

with tempfile.TemporaryDirectory() as d:
    make_set(d)
    ck = os.path.join(d, "ck.safetensors")
    out = os.path.join(d, "out")
    os.mkdir(out)
    original = open(ck, "rb").read()
    with open(ck, "ab") as stdout:
        p = run_cli("weights", os.path.join(d, "model.pte"), "--from", ck, "-o", out, stdout=stdout, stderr=-1)
    changed = open(ck, "rb").read() != original
    print(f"rc={p.returncode} (want 2); checkpoint changed={changed} (want False)")
    sys.exit(1 if changed or p.returncode != 2 else 0)
