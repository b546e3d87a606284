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
