"""Outputs never destroy inputs, and the CLI replaces an existing output only with
-f/--force (zstd's convention); the Python API keeps replacing, as upstream does."""

from __future__ import annotations

import os

import pytest
from _procs import SAFETY_S
from conftest import Mlp, export
from executorch.exir import ExecutorchBackendConfig

import ptdstream
from ptdstream.cli import main as cli_main
from ptdstream.pack import pack

ROOT = os.path.dirname(os.path.dirname(ptdstream.__file__))  # the ptdstream the subprocesses run


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    ptdstream.save(export(Mlp(), config=ExecutorchBackendConfig(external_constants=True)),
                   str(folder / "model.pte"))
    ptd = folder / "_default_external_constant.ptd"
    pack(str(ptd), str(folder / "w.ptd.zst"))
    return folder


def snapshot(folder) -> dict:
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder)) if not (folder / n).is_dir()}


def cli(capsys, *argv) -> tuple:
    code = cli_main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip()


@pytest.fixture
def work(model, tmp_path):
    for name in ("model.pte", "_default_external_constant.ptd", "w.ptd.zst"):
        (tmp_path / name).write_bytes((model / name).read_bytes())
    return tmp_path


def test_pack_onto_its_input_is_refused(work, capsys):
    before = snapshot(work)
    code, err = cli(capsys, "pack", work / "model.pte", work / "model.pte")
    assert code == 2
    assert err == (f"ptdstream pack: error: output {work / 'model.pte'} is also an input: "
                   "writing it would destroy the input; choose another output path")
    assert snapshot(work) == before


def test_force_never_allows_writing_over_an_input(work, capsys):
    before = snapshot(work)
    code, err = cli(capsys, "pack", "-f", work / "model.pte", work / "model.pte")
    assert code == 2 and "is also an input" in err
    assert snapshot(work) == before


@pytest.mark.parametrize("how", ["hard link", "symlink", "other spelling"])
def test_the_same_file_through_links_is_refused_naming_both(work, capsys, how):
    ptd = work / "_default_external_constant.ptd"
    alias = work / "alias.ptd"
    if how == "hard link":
        os.link(ptd, alias)
    elif how == "symlink":
        alias.symlink_to(ptd)
    else:
        alias = work / "." / "_default_external_constant.ptd"
    before = snapshot(work)
    code, err = cli(capsys, "manifest", work / "model.pte", ptd, "-o", alias, "-f")
    assert code == 2
    assert f"output {alias} is also an input" in err
    if how != "other spelling":
        assert f"(as {ptd})" in err
    assert snapshot(work) == before


def test_extract_onto_the_packed_input_is_refused(work, capsys):
    before = snapshot(work)
    code, err = cli(capsys, "extract", work / "w.ptd.zst", "--segment", "0", "-o", work / "w.ptd.zst")
    assert code == 2 and f"output {work / 'w.ptd.zst'} is also an input" in err
    assert snapshot(work) == before


def test_a_manifest_of_itself_over_itself_is_refused(work, capsys):
    (work / "m.manifest").write_bytes(b"old manifest")
    before = snapshot(work)
    code, err = cli(capsys, "manifest", work / "m.manifest")  # default output: m.manifest
    assert code == 2 and f"output {work / 'm.manifest'} is also an input" in err
    assert snapshot(work) == before


@pytest.mark.parametrize("command", ["pack", "unpack", "extract", "manifest"])
def test_an_existing_output_needs_force(work, capsys, command):
    out = work / "out.bin"
    out.write_bytes(b"keep me")
    argv = {
        "pack": ["pack", work / "model.pte", out],
        "unpack": ["unpack", work / "w.ptd.zst", out],
        "extract": ["extract", work / "w.ptd.zst", "--segment", "0", "-o", out],
        "manifest": ["manifest", work / "model.pte", "-o", out],
    }[command]
    before = snapshot(work)
    code, err = cli(capsys, *argv)
    assert (code, err) == (2, f"ptdstream {command}: error: output {out} exists; use -f/--force to replace it")
    assert snapshot(work) == before
    code, _ = cli(capsys, *argv[:1], "--force", *argv[1:])
    assert code == 0
    assert out.read_bytes() != b"keep me"


def test_the_python_api_keeps_replacing(work):
    out = work / "out.zst"
    out.write_bytes(b"old")
    pack(str(work / "model.pte"), str(out))
    assert out.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"  # a zstd frame


def _first_key(work) -> str:
    from ptdstream.format.reader import read_artifact

    return read_artifact(str(work / "_default_external_constant.ptd")).named[0].key


@pytest.mark.parametrize("mode", ["r+b", "ab"], ids=["1<>", ">>"])
@pytest.mark.parametrize("command", ["pack", "unpack", "extract", "inspect"])
def test_stdout_opened_on_an_input_is_refused_before_a_byte_is_written(work, command, mode):
    """``pack F - 1<> F``, ``unpack F.zst - >> F.zst``, ``extract F.zst KEY -o - 1<> F.zst``:
    stdout is the input itself (same device and inode); the command exits 2 naming
    it and the input keeps its bytes (a --json error goes to stderr only)."""
    import subprocess
    import sys

    target = work / ("model.pte" if command in ("pack", "inspect") else "w.ptd.zst")
    argv = {"pack": ["pack", target, "-"], "unpack": ["unpack", target, "-"],
            "extract": ["extract", target, _first_key(work), "-o", "-"], "inspect": ["inspect", target]}[command]
    before = snapshot(work)
    for extra in ([], ["--json"]):
        with open(target, mode) as stdout:
            proc = subprocess.run([sys.executable, "-m", "ptdstream", *map(str, argv), *extra], stdout=stdout,
                                  stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT), timeout=SAFETY_S)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.decode().strip() == (
            f"ptdstream {command}: error: standard output is the input {target}: writing to it would change "
            "the input; redirect stdout to another file" + ("" if command == "inspect" else " or give -o OUT"))
        assert snapshot(work) == before


def test_stdout_on_another_file_is_written(work):
    import subprocess
    import sys

    with open(work / "copy.zst", "wb") as stdout:
        proc = subprocess.run([sys.executable, "-m", "ptdstream", "pack", str(work / "model.pte"), "-", "-q"],
                              stdout=stdout, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT),
                              timeout=SAFETY_S)
    assert proc.returncode == 0, proc.stderr
    assert cli_main(["unpack", str(work / "copy.zst"), "-o", str(work / "copy.pte"), "-q"]) == 0
    assert (work / "copy.pte").read_bytes() == (work / "model.pte").read_bytes()


def _run_cli(argv, stdin, stdout):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "ptdstream", *map(str, argv)], stdin=stdin, stdout=stdout,
                          stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT), timeout=SAFETY_S)


@pytest.mark.parametrize("mode", ["r+b", "ab"], ids=["1<>", ">>"])
@pytest.mark.parametrize("command", ["pack", "unpack", "extract", "inspect", "verify"])
def test_stdin_on_the_file_stdout_is_open_on_is_refused_before_it_is_copied(work, command, mode):
    """``pack - -o - < F 1<> F``, ``inspect - < F >> F``, ``extract - KEY -o - < F.zst 1<> F.zst``:
    the input is stdin, and stdin's file is stdout's: exit 2 naming stdin, the file keeps
    its bytes (it was compared after stdin was copied to a temp file: exit 0, F overwritten)."""
    target = work / ("w.ptd.zst" if command in ("unpack", "extract") else "model.pte")
    argv = {"pack": ["pack", "-", "-o", "-"], "unpack": ["unpack", "-", "-o", "-"],
            "extract": ["extract", "-", _first_key(work), "-o", "-"], "inspect": ["inspect", "-"],
            "verify": ["verify", "-"]}[command]
    before = snapshot(work)
    with open(target, "rb") as stdin, open(target, mode) as stdout:
        proc = _run_cli(argv, stdin, stdout)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.decode().strip() == (
        f"ptdstream {command}: error: standard output is the input - (stdin): writing to it would change "
        "the input; redirect stdout to another file" + ("" if command in ("inspect", "verify") else " or give -o OUT"))
    assert snapshot(work) == before


def test_stdin_from_the_input_and_stdout_elsewhere_still_works(work):
    with open(work / "model.pte", "rb") as stdin, open(work / "copy.zst", "wb") as stdout:
        proc = _run_cli(["pack", "-", "-o", "-", "-q"], stdin, stdout)
    assert proc.returncode == 0, proc.stderr
    assert cli_main(["unpack", str(work / "copy.zst"), "-o", str(work / "copy.pte"), "-q"]) == 0
    assert (work / "copy.pte").read_bytes() == (work / "model.pte").read_bytes()


@pytest.fixture
def checkpoint(work):
    """``ck.safetensors`` (the program's weights + 1) and ``hf/``: the same keys as a
    Hugging Face sharded checkpoint (two shards and their index)."""
    import json

    import torch
    from safetensors.torch import save_file

    from ptdstream.format.reader import read_artifact

    keys = [n.key for n in read_artifact(str(work / "_default_external_constant.ptd")).named]
    tensors = {k: v.detach() + 1 for k, v in Mlp().state_dict().items()}
    assert sorted(tensors) == sorted(keys)
    save_file(tensors, str(work / "ck.safetensors"))
    (work / "hf").mkdir()
    first, rest = keys[:1], keys[1:]
    save_file({k: tensors[k] for k in first}, str(work / "hf" / "a.safetensors"))
    save_file({k: tensors[k] for k in rest}, str(work / "hf" / "b.safetensors"))
    index = {"weight_map": {**dict.fromkeys(first, "a.safetensors"), **dict.fromkeys(rest, "b.safetensors")}}
    (work / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    (work / "out").mkdir()
    torch.manual_seed(0)
    return work


@pytest.mark.parametrize("option,victim", [("--from", "ck.safetensors"), ("--from", "hf/b.safetensors"),
                                           ("--from", "hf/model.safetensors.index.json"),
                                           ("--old", "hf/a.safetensors")])
def test_weights_refuses_stdout_on_a_file_of_its_checkpoint(checkpoint, option, victim):
    """``weights model.pte --from ck.safetensors -o out/ >> ck.safetensors`` (and a shard or
    the index of a checkpoint folder, and --old): exit 2 naming the file, nothing changed
    (the checkpoint was no input: exit 0, the report appended to it)."""
    work = checkpoint
    source = work / ("ck.safetensors" if victim == "ck.safetensors" else "hf")
    argv = ["weights", work / "model.pte", "--from", source, "-o", work / "out"]
    if option == "--old":
        argv = ["weights", work / "model.pte", "--from", work / "ck.safetensors", "--old", source,
                "-o", work / "out"]
        if victim == "ck.safetensors":
            argv[argv.index("--from") + 1] = work / "hf"
    before = {**snapshot(work), **{f"hf/{k}": v for k, v in snapshot(work / "hf").items()}}
    with open(work / victim, "ab") as stdout:
        proc = _run_cli(argv, subprocess_devnull(), stdout)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.decode().strip().splitlines()[-1] == (
        f"ptdstream weights: error: standard output is the input {work / victim}: writing to it would change "
        "the input; redirect stdout to another file")
    assert {**snapshot(work), **{f"hf/{k}": v for k, v in snapshot(work / "hf").items()}} == before
    assert os.listdir(work / "out") == []


def test_weights_with_stdout_elsewhere_still_writes(checkpoint, tmp_path_factory):
    work = checkpoint
    log = tmp_path_factory.mktemp("log") / "report.txt"
    with open(log, "wb") as stdout:
        proc = _run_cli(["weights", work / "model.pte", "--from", work / "hf", "-o", work / "out"],
                        subprocess_devnull(), stdout)
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(work / "out") == ["_default_external_constant.ptd"]
    assert log.read_bytes() != b""


def test_recover_refuses_stdout_on_a_file_of_its_folder(work):
    """``recover DIR >> DIR/model.pte`` with nothing to recover appended its line to the program."""
    before = snapshot(work)
    with open(work / "model.pte", "ab") as stdout:
        proc = _run_cli(["recover", work], subprocess_devnull(), stdout)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.decode().strip() == (
        f"ptdstream recover: error: standard output is the input {work / 'model.pte'}: writing to it would "
        "change the input; redirect stdout to another file")
    assert snapshot(work) == before


def subprocess_devnull():
    import subprocess

    return subprocess.DEVNULL


@pytest.mark.parametrize("via", ["--from", "--like"])
def test_weights_onto_its_checkpoint_or_like_file_is_refused(work, tmp_path_factory, capsys, via):
    """``weights --from OUT/<tag>.ptd`` (a weights-only torch.save file under the
    output's name) or ``--like OUT/<tag>.ptd``: exit 2 naming it, folder unchanged."""
    import safetensors.torch as st
    import torch

    state = {k: v.detach().contiguous() for k, v in Mlp().state_dict().items()}
    ptd = work / "_default_external_constant.ptd"
    if via == "--from":
        torch.save(state, ptd)
        args = ["--from", ptd]
    else:
        ckpt = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
        st.save_file(state, ckpt)
        args = ["--from", ckpt, "--like", ptd]
    before = snapshot(work)
    code, err = cli(capsys, "weights", work / "model.pte", *args, "-o", work)
    assert code == 2
    assert err.splitlines()[-1] == (f"ptdstream weights: error: output {ptd} is also an input: "
                                    "writing it would destroy the input; choose another output path")
    assert snapshot(work) == before


def test_weights_needs_force_for_an_existing_ptd(checkpoint, capsys):
    """``weights model.pte --from ck -o DIR`` where DIR holds the export's .ptd: exit 2
    naming it and -f, DIR unchanged (it was replaced silently, and -f was refused)."""
    work = checkpoint
    ptd = work / "_default_external_constant.ptd"
    before = snapshot(work)
    code, err = cli(capsys, "weights", work / "model.pte", "--from", work / "ck.safetensors", "-o", work, "-q")
    assert code == 2
    assert err.splitlines()[-1] == f"ptdstream weights: error: output {ptd} exists; use -f/--force to replace it"
    assert snapshot(work) == before
    assert cli(capsys, "weights", work / "model.pte", "--from", work / "ck.safetensors", "-o", work / "out",
               "-q") == (0, "")
    assert cli(capsys, "weights", work / "model.pte", "--from", work / "ck.safetensors", "-o", work, "-f",
               "-q") == (0, "")
    assert ptd.read_bytes() == (work / "out" / ptd.name).read_bytes() != before[ptd.name]


def test_weights_reads_the_program_from_stdin(checkpoint, capsys, monkeypatch):
    """``weights - --from ck -o DIR < model.pte``: the .ptd of the program given as a file
    (``-`` was taken for a file named '-')."""
    import io
    import sys

    work = checkpoint
    with open(work / "model.pte", "rb") as pte:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(pte))
        assert cli(capsys, "weights", "-", "--from", work / "ck.safetensors", "-o", work / "piped", "-q") == (0, "")
    assert cli(capsys, "weights", work / "model.pte", "--from", work / "ck.safetensors", "-o", work / "out",
               "-q") == (0, "")
    assert snapshot(work / "piped") == snapshot(work / "out")


def test_weights_old_with_the_program_from_stdin_is_a_usage_error(checkpoint):
    """``--old`` writes a new .pte named after PROGRAM: from stdin it has no name."""
    work = checkpoint
    with open(work / "model.pte", "rb") as stdin:
        proc = _run_cli(["weights", "-", "--from", work / "ck.safetensors", "--old", work / "ck.safetensors",
                         "-o", work / "piped"], stdin, None)
    assert proc.returncode == 2
    assert proc.stderr.decode().strip() == ("ptdstream weights: --old writes a new .pte named after PROGRAM, "
                                            "which is - (stdin); give the program as a file")
    assert not (work / "piped").exists()
