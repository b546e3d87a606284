"""The committed flatc output in ptdstream/format/ equals a fresh generation from the
installed executorch's schemas (tools/gen_format_schema.sh), and reading needs no torch."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERATED = ("program_fb", "flat_tensor_fb", "fb_tables.py")


def _flatc():
    import importlib.util

    spec = importlib.util.find_spec("executorch")
    if spec is None:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "data", "bin", "flatc")
    return path if os.access(path, os.X_OK) else None


@pytest.mark.skipif(_flatc() is None, reason="executorch's flatc is not installed")
def test_generated_code_matches_a_fresh_generation(tmp_path):
    subprocess.run(["bash", os.path.join(ROOT, "tools", "gen_format_schema.sh"), str(tmp_path)],
                   check=True, capture_output=True, env=dict(os.environ, PYTHON=sys.executable))
    committed = os.path.join(ROOT, "ptdstream", "format")
    for name in GENERATED:
        fresh, mine = tmp_path / name, os.path.join(committed, name)
        if name.endswith(".py"):
            assert fresh.read_bytes() == open(mine, "rb").read(), name
            continue
        cmp = filecmp.dircmp(fresh, mine, ignore=["__pycache__"])
        assert (cmp.left_only, cmp.right_only, cmp.diff_files) == ([], [], []), name
        assert len(cmp.same_files) > 3


def test_reading_imports_neither_torch_nor_executorch(tmp_path):
    code = ("import sys, ptdstream.format.reader as r, ptdstream.check.structure; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'executorch')]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_read_commands_import_neither_torch_nor_executorch(tmp_path):
    from conftest import Mlp, export, reference_files

    reference_files(export(Mlp()), str(tmp_path))
    pte = str(tmp_path / "model.pte")
    code = ("import sys; from ptdstream.cli import main; "
            "codes = [main([c, sys.argv[1]]) for c in ('verify', 'inspect')]; "
            "print(codes, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'executorch'}))")
    out = subprocess.run([sys.executable, "-c", code, pte], check=True, capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "[0, 0] []"
