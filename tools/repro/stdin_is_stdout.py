"""Claim 4: standard output open on an input is refused before a byte is written.

`-` (stdin) is an input too, but stdin's file is never compared with stdout:

    ptdstream pack   - -o -          < F       1<> F
    ptdstream inspect -               < F       >> F
    ptdstream unpack - -o -          < F.zst   1<> F.zst
    ptdstream extract - KEY -o -     < F.zst   1<> F.zst

Expected: exit 2, "standard output is the input ...", F unchanged.
Actual:   exit 0, F overwritten / appended to (the input is destroyed).

Run: PYTHONPATH=. python tools/repro/stdin_is_stdout.py   (exit 1 = bug present)
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import PTD, make_set, run_cli

bugs = 0
with tempfile.TemporaryDirectory() as d:
    make_set(d)
    cases = [(("pack", "-", "-o", "-"), PTD, "r+b"), (("inspect", "-"), PTD, "ab"),
             (("unpack", "-", "-o", "-"), "w.ptd.zst", "r+b"),
             (("extract", "-", "l1.weight", "-o", "-"), "w.ptd.zst", "r+b")]
    for argv, name, mode in cases:
        path = os.path.join(d, name)
        original = open(path, "rb").read()
        with open(path, "rb") as stdin, open(path, mode) as stdout:
            p = run_cli(*argv, stdin=stdin, stdout=stdout, stderr=-1)
        changed = open(path, "rb").read() != original
        ok = p.returncode == 2 and not changed
        bugs += not ok
        print(f"{'OK ' if ok else 'BUG'} ptdstream {' '.join(argv)} < {name} {'>>' if mode == 'ab' else '1<>'} {name}: "
              f"rc={p.returncode} (want 2), input changed={changed} (want False)")
        open(path, "wb").write(original)
sys.exit(1 if bugs else 0)
