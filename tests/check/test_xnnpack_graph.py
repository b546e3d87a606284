"""Single-byte changes inside an XNNPACK delegate blob: verify accepts none that the
runtime's XNNPACK backend refuses at method load (check/runtime/xnnpack_blob + check/runtime/xnnpack_graph),
and the unchanged export still passes."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from conftest import export_xnnpack_mlp_tagged

from ptdstream.check.structure import check_structure
from ptdstream.format.reader import read_artifact

# Loads each .pte on argv (the .ptd first) and prints "index ok|err"; a crash ends the run.
_JUDGE = """
import sys
from executorch.runtime import Runtime
rt = Runtime.get()
for i, p in enumerate(sys.argv[2:]):
    try:
        prog = rt.load_program(p, data_path=sys.argv[1])
        for m in prog.method_names:
            prog.load_method(m)
        r = "ok"
    except Exception:
        r = "err"
    print(i, r, flush=True)
"""


def _runtime_loads(ptd, paths):
    """{path: True if the runtime loads every method} (a crash counts as a refusal)."""
    out, start = {}, 0
    while start < len(paths):
        proc = subprocess.run([sys.executable, "-c", _JUDGE, ptd, *paths[start:]], capture_output=True, text=True)
        lines = [line.split() for line in proc.stdout.splitlines() if line.strip()]
        for i, r in lines:
            out[paths[start + int(i)]] = r == "ok"
        start += len(lines)
        if start < len(paths) and proc.returncode != 0:
            out[paths[start]] = False
            start += 1
    return out


@pytest.mark.slow
def test_verify_refuses_what_xnnpack_init_refuses(tmp_path):
    pte, ptd = export_xnnpack_mlp_tagged(tmp_path)
    assert check_structure(pte, [ptd]).ok, check_structure(pte, [ptd]).summary()
    seg = next(s for s in read_artifact(pte).segments if s.label.startswith("delegate blob"))
    data = open(pte, "rb").read()
    rng = random.Random(0)
    accepted = []
    for i in range(600):
        off = seg.start + rng.randrange(seg.nbytes)
        byte = rng.randrange(256)
        if byte == data[off]:
            byte ^= 1
        mutant = bytearray(data)
        mutant[off] = byte
        path = str(tmp_path / f"m{i}.pte")
        with open(path, "wb") as f:
            f.write(mutant)
        if check_structure(path, [ptd]).ok:
            accepted.append((path, off - seg.start, data[off], byte))
    assert len(accepted) < 300  # most changes are refused
    loads = _runtime_loads(ptd, [a[0] for a in accepted])
    bad = [a[1:] for a in accepted if not loads[a[0]]]
    assert not bad, f"verify accepts {len(bad)} (blob offset, old, new) the runtime refuses: {bad}"
