"""A ``-`` input whose standard input is open on one of the outputs (``pack - -o F -f
< F``): refused before stdin is read, exit 2 naming the output, nothing changed. The
rule beside it, standard output open on an input, is in tests/test_hostile_inputs.py."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import torch
from conftest import Mlp, export
from executorch.exir import ExecutorchBackendConfig

import ptdstream

PTD = "_default_external_constant.ptd"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(folder, *argv, stdin):
    """``python -m ptdstream ARGV`` in ``folder`` with ``stdin``: (rc, stderr text)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "ptdstream", *argv], cwd=folder, env=env, stdin=stdin,
                       capture_output=True, timeout=300)
    return p.returncode, p.stderr.decode(errors="replace")


def digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """model.pte + its .ptd (external constants), a safetensors checkpoint and the .ptd packed."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    model = Mlp()
    ptdstream.save(export(model, config=ExecutorchBackendConfig(external_constants=True)), str(folder / "model.pte"))
    save_file({k: v.detach().clone() + 1 for k, v in model.state_dict().items()}, str(folder / "ck.safetensors"))
    rc, err = cli(folder, "pack", PTD, "-o", "w.ptd.zst", "-q", stdin=subprocess.DEVNULL)
    assert rc == 0, err
    (folder / "out").mkdir()
    (folder / "out" / PTD).write_bytes((folder / PTD).read_bytes())
    return folder


@pytest.mark.parametrize("argv, victim", [
    (("pack", "-", "-o", PTD, "-f"), PTD),
    (("unpack", "-", "-o", "w.ptd.zst", "-f"), "w.ptd.zst"),
    (("extract", "-", "l1.weight", "-o", "w.ptd.zst", "-f"), "w.ptd.zst"),
    (("weights", "-", "--from", "ck.safetensors", "-o", "out", "-f"), f"out/{PTD}"),
], ids=["pack", "unpack", "extract", "weights"])
def test_stdin_open_on_an_output_is_refused_and_nothing_changes(base, argv, victim):
    before = {name: digest(base / name) for name in ("model.pte", PTD, "w.ptd.zst", f"out/{PTD}")}
    listing = sorted(os.listdir(base))
    with open(base / victim, "rb") as stdin:
        rc, err = cli(base, *argv, stdin=stdin)
    assert (rc, err) == (2, f"ptdstream {argv[0]}: error: output {argv[argv.index('-o') + 1]}"
                            f"{'/' + PTD if argv[0] == 'weights' else ''} is the file standard input (-) reads: "
                            "writing it would destroy the input; choose another output path\n")
    assert {name: digest(base / name) for name in before} == before
    assert sorted(os.listdir(base)) == listing and os.listdir(base / "out") == [PTD]


def test_stdin_on_another_file_is_read_as_before(base, tmp_path):
    """The check compares files: stdin open on a file that is no output is packed as ever."""
    with open(base / PTD, "rb") as stdin:
        rc, err = cli(tmp_path, "pack", "-", "-o", "new.zst", "-q", stdin=stdin)
    assert rc == 0, err
    rc, err = cli(tmp_path, "unpack", "new.zst", "-o", "back", "-q", stdin=subprocess.DEVNULL)
    assert rc == 0, err
    assert digest(tmp_path / "back") == digest(base / PTD)
