"""``ptdstream weights``: usage errors answered before torch is imported (``-o -``, an
-o under a file, a file of the wrong kind), and the ``problems``
list of its ``--json`` error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from _procs import SAFETY_S
from _small_exports import model, write_reference

from ptdstream.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXT_PTD = "_default_external_constant.ptd"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The external-constants program, its .ptd, and its weights as a safetensors file."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("exported")
    files = write_reference("external", folder / "ref")
    save_file({k: v.detach().contiguous() for k, v in model("external").state_dict().items()},
              str(folder / "ck.safetensors"))
    return files["model.pte"], files[EXT_PTD], str(folder / "ck.safetensors")


@pytest.fixture
def work(exported, tmp_path):
    """A copy of ``exported`` in ``tmp_path``: model.pte, model.ptd (its data), ck.safetensors."""
    pte, ptd, ck = exported
    for src, name in ((pte, "model.pte"), (ptd, "model.ptd"), (ck, "ck.safetensors")):
        shutil.copyfile(src, tmp_path / name)
    return tmp_path


def _cli(cwd, *argv, stdin=None) -> tuple[int, list[str], str, list[str]]:
    """``python -X importtime -m ptdstream ARGV`` in ``cwd``: exit code, stderr lines,
    stdout, and the modules it imported (``PTDSTREAM_DEBUG=1``: the import of torch is
    not silenced, so it shows in the list)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ptdstream", *map(str, argv)], cwd=cwd,
                          capture_output=True, text=True, timeout=SAFETY_S, stdin=stdin,
                          env=dict(os.environ, PYTHONPATH=ROOT, PTDSTREAM_DEBUG="1"))
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    modules = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    return proc.returncode, lines, proc.stdout, modules


def _snapshot(folder) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, names in os.walk(folder) for f in names}


def test_output_dash_is_a_usage_error_and_makes_no_folder(work):
    before = _snapshot(work)
    rc, err, out, modules = _cli(work, "weights", "model.pte", "--from", "ck.safetensors", "-o", "-")
    assert (rc, err, out) == (2, ["ptdstream weights: -o -: the .ptd files need a folder, not standard output; "
                                  "give a folder (./- if a folder named - is meant)"], "")
    assert "torch" not in modules
    assert not os.path.lexists(work / "-") and _snapshot(work) == before
    rc, err, _, _ = _cli(work, "weights", "model.pte", "--from", "ck.safetensors", "-o", "./-")
    assert rc == 0, err  # the folder named - when it is spelled so
    assert os.listdir(work / "-") == [EXT_PTD]


def test_wrong_kinds_of_file_and_an_output_under_a_file_answer_before_torch(work):
    (work / "afile").write_bytes(b"kept")
    cases = [
        (["model.ptd", "--from", "ck.safetensors", "-o", "new"],
         "ptdstream weights: model.ptd is a .ptd (FlatTensor data), not a program: PROGRAM is the .pte exported "
         "with it; a .ptd of that export goes to --like (its tags and key order)"),
        (["model.pte", "--from", "model.pte", "-o", "new"],
         "ptdstream weights: --from model.pte is a .pte (an ExecuTorch program), not a checkpoint: give the new "
         "weights (a .safetensors file, a Hugging Face folder or a torch.save state dict); the program goes "
         "first, as PROGRAM"),
        (["model.pte", "--from", "model.ptd", "-o", "new"],
         "ptdstream weights: --from model.ptd is a .ptd (FlatTensor data), not a checkpoint: give the new "
         "weights (a .safetensors file, a Hugging Face folder or a torch.save state dict); a .ptd of the "
         "original export goes to --like"),
        (["model.pte", "--from", "ck.safetensors", "--like", "model.pte", "-o", "new"],
         "ptdstream weights: --like model.pte is a .pte (an ExecuTorch program), not a .ptd: --like takes the "
         ".ptd files of the original export; the program goes first, as PROGRAM"),
        (["model.pte", "--from", "ck.safetensors", "-o", "afile/sub"],
         "ptdstream: cannot write afile/sub: Not a directory"),
    ]
    before = _snapshot(work)
    for argv, message in cases:
        rc, err, out, modules = _cli(work, "weights", *argv)
        assert (rc, err, out) == (2, [message], ""), argv
        assert "torch" not in modules and "executorch" not in modules, argv
    with open(work / "model.ptd", "rb") as stdin:
        rc, err, _, modules = _cli(work, "weights", "-", "--from", "ck.safetensors", "-o", "new", stdin=stdin)
    assert (rc, err[0].split(" is a .ptd")[0]) == (2, "ptdstream weights: - (stdin)") and "torch" not in modules
    assert _snapshot(work) == before


def test_json_error_lists_each_problem(work, capsys):
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model("external").state_dict().items()}
    names = sorted(state)
    wrong = {k: v for k, v in state.items() if k != names[0]}
    wrong[names[1]] = state[names[1]].double()
    save_file(wrong, str(work / "wrong.safetensors"))
    capsys.readouterr()
    rc = main(["weights", str(work / "model.pte"), "--from", str(work / "wrong.safetensors"),
               "-o", str(work / "out"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert (rc, doc["ok"], doc["exit_code"], len(doc["problems"])) == (1, False, 1, 2)
    assert names[0] in doc["problems"][0] + doc["problems"][1] and names[1] in doc["problems"][1] + doc["problems"][0]
    assert all(problem in doc["error"] for problem in doc["problems"])
    assert doc["error"].startswith(f"ptdstream: {work / 'wrong.safetensors'} does not fit {work / 'model.pte'} "
                                   "(2 problem(s); nothing written): ")
    assert not (work / "out").exists()
