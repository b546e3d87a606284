"""Answers before the slow part: every check that needs neither torch nor the readers
(an input exists, an output exists or is an input, option combinations) answers with
torch, numpy, flatbuffers and zstandard made unimportable, on both command lines
(``ptdstream`` and ``python -m ptdstream.hf``). A check made after one of those
imports would fail with the ImportError instead of its one line."""

from __future__ import annotations

import os

import pytest
from _unimportable import run_without

EXT_PTD = "_default_external_constant.ptd"


def _files(folder, *names: str) -> None:
    """Small files that stand in for inputs: nothing is read past their first bytes."""
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not read")


def test_the_harness_makes_torch_unimportable(tmp_path):
    proc = run_without(tmp_path, ["-c", "import torch"])
    assert proc.returncode == 1 and "torch: made unimportable by the test" in proc.stderr


@pytest.mark.parametrize("argv,missing", [
    (["verify", "absent.pte"], "absent.pte"),
    (["verify", "in.pte", "absent.ptd"], "absent.ptd"),
    (["verify", "in.pte", "--against", "absent.pte"], "absent.pte"),
    (["verify", "in.pte", "--manifest", "absent.manifest"], "absent.manifest"),
    (["inspect", "absent.ptd"], "absent.ptd"),
    (["manifest", "absent.pte"], "absent.pte"),
    (["pack", "absent.ptd"], "absent.ptd"),
    (["unpack", "absent.ptd.zst"], "absent.ptd.zst"),
    (["extract", "absent.ptd.zst", "--list"], "absent.ptd.zst"),
    (["weights", "absent.pte", "--from", "ck.safetensors", "-o", "new"], "absent.pte"),
    (["weights", "in.pte", "--from", "absent.safetensors", "-o", "new"], "absent.safetensors"),
])
def test_a_missing_input_answers_before_the_readers_are_imported(tmp_path, argv, missing):
    _files(tmp_path, "in.pte", "ck.safetensors")
    proc = run_without(tmp_path, ["-m", "ptdstream", *argv], cwd=tmp_path)
    assert (proc.returncode, proc.stderr, proc.stdout) == (
        2, f"ptdstream: cannot read {missing}: No such file or directory\n", ""), argv
    assert sorted(os.listdir(tmp_path)) == ["ck.safetensors", "in.pte", "unimportable-site"]


def test_an_input_under_a_file_gives_the_reason_open_would(tmp_path):
    _files(tmp_path, "in.pte")
    proc = run_without(tmp_path, ["-m", "ptdstream", "inspect", "in.pte/x.ptd"], cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (2, "ptdstream: cannot read in.pte/x.ptd: Not a directory\n")


@pytest.mark.parametrize("extra,existing", [
    ([], f"new/{EXT_PTD}"),
    (["--tag", "weights"], "new/weights.ptd"),
    (["--like", "old/model.ptd"], "new/model.ptd"),
    (["--like", "old/a.ptd", "--like", "old/b.ptd"], "new/b.ptd"),
    (["--like", "old/model.ptd", "--old", "old.safetensors"], "new/in.pte"),
])
def test_weights_refuses_an_existing_output_before_torch(tmp_path, extra, existing):
    """The files ``weights`` writes are named by the tags (the --like files' names,
    --tag or the default) and, with --old, the program's name: one that exists is
    refused at once without -f. Before, it was refused after the checkpoint was
    checked and torch imported (66 s on a loaded machine)."""
    _files(tmp_path, "in.pte", "ck.safetensors", "old.safetensors", "old/model.ptd", "old/a.ptd", "old/b.ptd",
           existing)
    before = (tmp_path / existing).read_bytes()
    proc = run_without(tmp_path, ["-m", "ptdstream", "weights", "in.pte", "--from", "ck.safetensors", "-o", "new",
                                  *extra], cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (
        2, f"ptdstream weights: error: output {existing} exists; use -f/--force to replace it\n")
    assert (tmp_path / existing).read_bytes() == before


def test_weights_refuses_an_output_that_is_an_input_even_with_force(tmp_path):
    _files(tmp_path, "in.pte", "ck.safetensors", "out/model.ptd")
    proc = run_without(tmp_path, ["-m", "ptdstream", "weights", "in.pte", "--from", "ck.safetensors", "-o", "out",
                                  "--like", "out/model.ptd", "-f"], cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (
        2, "ptdstream weights: error: output out/model.ptd is also an input: writing it would destroy the input; "
           "choose another output path\n")


def test_weights_with_force_gets_past_the_checks(tmp_path):
    """With -f the existing output is no answer: the command goes on to import torch
    (here unimportable, so it fails there, after every check passed)."""
    _files(tmp_path, "in.pte", "ck.safetensors", f"new/{EXT_PTD}")
    proc = run_without(tmp_path, ["-m", "ptdstream", "weights", "in.pte", "--from", "ck.safetensors", "-o", "new",
                                  "-f"], cwd=tmp_path)
    assert proc.returncode == 1 and "made unimportable by the test" in proc.stderr, proc.stderr


def _hf(tmp_path, *argv):
    (tmp_path / "my-llama").mkdir(exist_ok=True)
    (tmp_path / "my-llama" / "config.json").write_text("{}")
    (tmp_path / "my-llama" / "model.safetensors").write_bytes(b"")  # --weightless answers a folder without any
    return run_without(tmp_path, ["-m", "ptdstream.hf", "export", "executorch", "-m", "my-llama", "--task",
                                  "text-generation", "--recipe", "xnnpack", *argv], cwd=tmp_path)


@pytest.mark.parametrize("option", ["-o", "--output_dir"])
def test_hf_refuses_an_output_folder_holding_an_export_before_torch(tmp_path, option):
    _files(tmp_path, "out/model.pte", "out/model.ptd", "out/tokenizer.json")
    proc = _hf(tmp_path, option, "out")
    assert (proc.returncode, proc.stderr) == (
        2, "ptdstream.hf: error: -o out holds model.pte, model.ptd (an earlier export?); use -f/--force to replace "
           "its .pte/.ptd files, or give another folder\n")
    proc = _hf(tmp_path, f"{option}=out", "--weightless")
    assert proc.returncode == 2 and proc.stderr.startswith("ptdstream.hf: error: -o out holds model.pte"), proc.stderr


def test_hf_refuses_an_output_that_is_a_file(tmp_path):
    _files(tmp_path, "out")
    proc = _hf(tmp_path, "-o", "out", "-f")
    assert (proc.returncode, proc.stderr) == (
        2, "ptdstream.hf: error: -o out: a file, not a folder; give the folder for the .pte/.ptd files\n")


@pytest.mark.parametrize("argv", [["-o", "out", "-f"], ["-o", "empty"], ["-o", "other"], ["-o", "new/deeper"]])
def test_hf_goes_on_for_a_new_or_forced_output(tmp_path, argv):
    """A missing folder, an empty one, one without .pte/.ptd files, or -f: no answer from
    the checks; the export imports optimum (unimportable here, so it fails there)."""
    _files(tmp_path, "out/model.pte", "other/tokenizer.json")
    (tmp_path / "empty").mkdir()
    proc = _hf(tmp_path, *argv)
    assert proc.returncode == 1 and "made unimportable by the test" in proc.stderr, proc.stderr
    assert not proc.stderr.startswith("ptdstream.hf: error:")


@pytest.mark.parametrize("extra", [[], ["-f"]])
def test_hf_weightless_quantization_not_covered_is_refused_before_torch(tmp_path, extra):
    """A quantization value --weightless does not stream (fpa4w: Apple MPS) is refused before
    torch is imported; the covered ones (8da4w, 8w) go on to the export (issue 33)."""
    proc = _hf(tmp_path, "-o", "out", "--weightless", "--qlinear", "fpa4w", "--qembedding=8w", *extra)
    assert (proc.returncode, proc.stderr) == (
        1, "ptdstream.hf: error: my-llama: --qlinear 'fpa4w': --weightless quantizes each weight as it is read "
           "only with qlinear 8da4w, 8da8w, 4w, 8w; qlinear_encoder 8da4w, 8da8w, 4w, 8w; qembedding 8w, 4w; "
           "qembedding_encoder 8w, 4w; use one of them, or export without --weightless\n")
    assert not (tmp_path / "out").exists()
    proc = _hf(tmp_path, "-o", "out", "--weightless", "--qlinear", "8da4w", "--qembedding=8w", *extra)
    assert proc.returncode == 1 and "made unimportable by the test" in proc.stderr, proc.stderr
    assert not proc.stderr.startswith("ptdstream.hf: error:")


@pytest.mark.parametrize("argv,message", [
    (["verify", "absent.pte", "b.ptd", "--against", "c.pte"],
     "ptdstream verify: --against compares one FILE, got 2 (see ptdstream verify --help)"),
    (["verify", "absent.pte", "--against", "c.pte", "--manifest", "m"],
     "ptdstream verify: use either --against or --manifest (see ptdstream verify --help)"),
    (["verify", "absent.pte", "--against", "c.pte", "--kernels", "portable"],
     "ptdstream verify: --kernels is for the structure check, not with --against or --manifest "
     "(see ptdstream verify --help)"),
    (["manifest", "absent.pte", "--piece-size", "100"],
     "ptdstream manifest: --piece-size must be at least 4096 (bytes), got 100"),
])
def test_option_combinations_answer_first(tmp_path, argv, message):
    """An option combination that cannot run is the answer, before a missing file
    and before anything is imported."""
    proc = run_without(tmp_path, ["-m", "ptdstream", *argv], cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (2, message + "\n")
