"""Hostile inputs against the README's reliability claims, each with its exact
outcome (exit code, error text, files unchanged byte for byte): standard output open
on an input is refused before a byte is written (claim 4); a planted pickle beside a
checkpoint or in its place is never unpickled, and a deeply nested safetensors header
is one line, exit 1 (claim 2); a manifest giving a 2^40-byte block is refused without
reading (claim 3); a journal naming its folder through ``.`` is refused, touching
nothing (claim 1).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from conftest import Mlp, export
from executorch.exir import ExecutorchBackendConfig

import ptdstream
from ptdstream.manifest import codec as manifest_codec
from ptdstream.manifest.describe import write_manifest
from ptdstream.write import journal, tempfiles

PTD = "_default_external_constant.ptd"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "PWNED"


def cli(*argv, stdin=None, stdout=None, timeout=120):
    """``python -m ptdstream ARGV`` in a child; (rc, stdout or b'', stderr text)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "ptdstream", *map(os.fspath, argv)], env=env, stdin=stdin,
                       stdout=stdout if stdout is not None else subprocess.PIPE, stderr=subprocess.PIPE,
                       timeout=timeout)
    err = "\n".join(line for line in p.stderr.decode(errors="replace").splitlines()
                    if "torchao" not in line and "_pytree" not in line and "Failed to load" not in line)
    return p.returncode, (p.stdout or b""), err


def inproc(capsys, *argv):
    """``ptdstream ARGV`` in this process (torch already imported): (rc, stderr)."""
    from ptdstream.cli import main

    capsys.readouterr()
    rc = main([os.fspath(a) for a in argv])
    return rc, capsys.readouterr().err


def digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """model.pte + its .ptd (external constants), a safetensors checkpoint of new weights, a pack."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    model = Mlp()
    manager = export(model, config=ExecutorchBackendConfig(external_constants=True))
    ptdstream.save(manager, str(folder / "model.pte"))
    save_file({k: v.detach().clone() + 1 for k, v in model.state_dict().items()}, str(folder / "ck.safetensors"))
    rc, _, err = cli("pack", folder / PTD, "-o", folder / "w.ptd.zst", "-q")
    assert rc == 0, err
    return folder


@pytest.fixture
def work(base, tmp_path):
    for name in os.listdir(base):
        shutil.copy(base / name, tmp_path / name)
    return tmp_path


# ---- claim 4: standard output open on an input is refused before a byte is written

@pytest.mark.parametrize("argv, victim, mode", [
    (("pack", PTD, "-"), PTD, "ab"),
    (("pack", PTD, "-o", "-"), PTD, "r+b"),
    (("unpack", "w.ptd.zst", "-"), "w.ptd.zst", "ab"),
    (("extract", "w.ptd.zst", "l1.weight", "-o", "-"), "w.ptd.zst", "r+b"),
    (("inspect", PTD), PTD, "ab"),
    (("manifest", "model.pte", PTD, "-o", "-"), "model.pte", "ab"),
], ids=["pack>>", "pack1<>", "unpack>>", "extract1<>", "inspect>>", "manifest>>"])
def test_stdout_on_an_input_is_refused_and_the_input_is_unchanged(work, argv, victim, mode):
    before = digest(work / victim)
    with open(work / victim, mode) as out:
        rc, _, err = cli(*[work / a if (work / a).exists() else a for a in argv], stdout=out)
    assert rc == 2, err
    assert "standard output is the input" in err and victim in err and "Traceback" not in err
    assert digest(work / victim) == before


# ---- claim 2: checkpoints run no code

@pytest.fixture
def planted(work):
    """A Hugging Face style folder: model.safetensors and a .metadata pickle that would touch a marker."""
    hf = work / "hf"
    hf.mkdir()
    shutil.copy(work / "ck.safetensors", hf / "model.safetensors")

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {work / MARKER}",))

    (hf / ".metadata").write_bytes(pickle.dumps(Evil()))
    return hf


def test_a_planted_dcp_metadata_beside_safetensors_is_never_unpickled(work, planted, capsys):
    out = work / "o"
    out.mkdir()
    rc, err = inproc(capsys, "weights", work / "model.pte", "--from", planted, "-o", out, "-q")
    assert rc == 0, err
    assert not (work / MARKER).exists()
    assert os.listdir(out) == [PTD]
    # -f: the existing output answers before the checkpoint is looked at (issue 35)
    rc, err = inproc(capsys, "weights", work / "model.pte", "--from", planted, "--format", "dcp", "-o", out, "-q", "-f")
    assert rc == 1 and "which is never read as DCP" in err, err
    assert not (work / MARKER).exists()
    assert os.listdir(out) == [PTD]


def test_a_planted_pickle_is_refused_everywhere_detection_could_reach_it(work, planted, capsys):
    out = work / "o"
    out.mkdir()
    only = work / "dcponly"
    only.mkdir()
    shutil.copy(planted / ".metadata", only / ".metadata")
    idx = work / "idx"
    idx.mkdir()
    shutil.copy(planted / ".metadata", idx / ".metadata")
    (idx / "model.safetensors.index.json").write_text('{"weight_map": {"l1.weight": ".metadata"}}')
    cases = [(only, "never read unasked; pass --format dcp"),
             (only / ".metadata", "weights_only=True) failed"),
             (idx, "not a safetensors file")]
    for source, fragment in cases:
        rc, err = inproc(capsys, "weights", work / "model.pte", "--from", source, "-o", out, "-q")
        assert rc == 1 and fragment in err and "Traceback" not in err, (source, err)
    assert not (work / MARKER).exists()
    assert os.listdir(out) == []
    with pytest.raises(ptdstream.errors.FormatError):
        ptdstream.write_ptd(program=str(work / "model.pte"), checkpoint=str(only), out_dir=str(out))
    assert not (work / MARKER).exists()


def test_a_deeply_nested_safetensors_header_is_one_line_exit_1(work, capsys):
    header = b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    (work / "deep.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    out = work / "o"
    out.mkdir()
    rc, err = inproc(capsys, "weights", work / "model.pte", "--from", work / "deep.safetensors", "-o", out)
    assert rc == 1 and "deep.safetensors" in err and err.count("\n") == 1 and "Traceback" not in err
    assert os.listdir(out) == []


# ---- claim 3: a lying manifest

def test_a_manifest_block_size_of_2_40_is_refused_without_reading(work):
    path = work / "data.bin"
    path.write_bytes(os.urandom(1 << 20))
    manifest = write_manifest([str(path)], str(work / "real.manifest"))
    entry = dataclasses.replace(manifest.files[0], block_nbytes=1 << 40)
    (work / "lie.manifest").write_bytes(manifest_codec.to_bytes(dataclasses.replace(manifest, files=(entry,))))
    rc, out, err = cli("verify", path, "--manifest", work / "lie.manifest")
    assert rc == 1 and "gives block size 1099511627776 bytes" in err and "refused" in err


# ---- claim 1: untrusted journals

def test_a_journal_naming_the_folder_itself_through_dot_is_refused_untouched(tmp_path):
    folder = str(tmp_path)
    (tmp_path / "a.ptd").write_bytes(b"old")
    temp, fd, lock = tempfiles.create_locked(os.path.join(folder, "a.ptd"))
    os.write(fd, b"new")
    os.close(fd)
    os.close(lock)
    name = ".a.ptd.ptdstream-1-00000000.journal"
    st = os.lstat(temp)
    new = {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "ctime_ns": st.st_ctime_ns,
           "mtime_ns": st.st_mtime_ns}
    bad = {"target": "./a.ptd", "temp": os.path.basename(temp), "backup": None, "had_target": True,
           "dev": st.st_dev, "ino": st.st_ino, "mark": None, "new": new, "old": new}
    fst = os.stat(folder)
    (tmp_path / name).write_text(json.dumps({"ptdstream_journal": journal.JOURNAL_VERSION, "entries": [bad],
                                             "folder": [fst.st_dev, fst.st_ino], "main": None, "members": []}))
    with pytest.raises(journal.RecoveryError, match="is not a plain file name"):
        journal.recover(folder)
    assert (tmp_path / "a.ptd").read_bytes() == b"old" and os.path.exists(temp) and (tmp_path / name).exists()
