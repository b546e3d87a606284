"""A Hugging Face folder whose index names a shard that is missing, unreadable (a
folder in its place) or outside the folder: one line naming the index, the shard
and its keys (``CheckpointFileError``), nothing written, no traceback, exit 1,
the same through ``weights_from``, ``ptdstream weights`` and
``python -m ptdstream.hf ... --weightless`` (and ``ptdstream.hf.export``)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings

import pytest
import torch
from _checkpoints import save_checkpoint, state_of
from conftest import Mlp

import ptdstream
from ptdstream.cli import main

warnings.filterwarnings("ignore")
CASES = ("missing", "a-folder", "outside")
INDEX = "model.safetensors.index.json"


def _break(folder: str, case: str) -> tuple[str, str, list[str]]:
    """Break the index's second shard in ``folder`` (in place) as ``case`` says; returns
    the index, the shard's name as the index names it, and the keys it holds."""
    index = os.path.join(folder, INDEX)
    with open(index) as f:
        content = json.load(f)
    shard = sorted(set(content["weight_map"].values()))[1]
    keys = [k for k, v in content["weight_map"].items() if v == shard]
    if case == "missing":
        os.remove(os.path.join(folder, shard))
    elif case == "a-folder":
        os.remove(os.path.join(folder, shard))
        os.mkdir(os.path.join(folder, shard))
    else:  # the index names the shard beside the folder; there is a good file there
        shutil.move(os.path.join(folder, shard), os.path.join(os.path.dirname(folder), shard))
        content["weight_map"] = {k: ("../" + v if v == shard else v) for k, v in content["weight_map"].items()}
        with open(index, "w") as f:
            json.dump(content, f)
        shard = "../" + shard
    return index, shard, keys


def _message(index: str, shard: str, keys: list[str], case: str) -> str:
    folder = os.path.dirname(index)
    named = f"{len(keys)} key(s): " + ", ".join(repr(k) for k in keys[:2]) + (", ..." if len(keys) > 2 else "")
    if case == "missing":
        return (f"{index}: shard {shard!r} (for {named}) is not in {folder} (the folder is incomplete: copy the "
                "shard there, or save or download the model again)")
    if case == "a-folder":
        return f"{index}: shard {shard!r} (for {named}) cannot be read: Is a directory"
    return (f"{index}: shard name {shard!r} (for {named}) is not a file name in the index's folder {folder} (a "
            "checkpoint is read only from its own folder)")


def _one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """An Mlp's external-constants program and its weights as a two-shard Hugging Face folder."""
    from executorch.exir import ExecutorchBackendConfig, to_edge

    torch.manual_seed(0)
    real = Mlp().eval()
    base = tmp_path_factory.mktemp("mlp")
    manager = to_edge(torch.export.export(real, (torch.randn(2, 64),))).to_executorch(
        ExecutorchBackendConfig(external_constants=True))
    with open(base / "model.pte", "wb") as f:
        manager.write_to_file(f)
    return str(base / "model.pte"), save_checkpoint("hf-sharded", state_of(real), base / "ckpt")


@pytest.mark.parametrize("case", CASES)
def test_weights_from_and_ptdstream_weights_name_the_shard_in_one_line(mlp, tmp_path, capsys, case):
    program, good = mlp
    folder = shutil.copytree(good, tmp_path / "ckpt")
    index, shard, keys = _break(str(folder), case)
    want = _message(index, shard, keys, case)
    with pytest.raises(ptdstream.CheckpointFileError) as raised:
        with ptdstream.weights_from(folder):
            pass
    assert str(raised.value) == want
    assert isinstance(raised.value, OSError) and raised.value.errno == {
        "missing": errno.ENOENT, "a-folder": errno.EISDIR, "outside": None}[case]
    capsys.readouterr()
    rc = main(["weights", program, "--from", str(folder), "-o", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert (rc, out, _one_line(err)) == (1, "", f"ptdstream: invalid file: {want}")
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama folder in three shards, as save_pretrained writes it."""
    pytest.importorskip("optimum.exporters.executorch", reason="needs ptdstream[hf] (bash tools/setup.sh --hf)")
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    folder = tmp_path_factory.mktemp("llama") / "model"
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder), max_shard_size="20KB")
    return str(folder)


@pytest.mark.hf
@pytest.mark.parametrize("case", CASES)
def test_the_hf_route_names_the_shard_in_one_line(llama, tmp_path, capsys, monkeypatch, case):
    import ptdstream.hf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = shutil.copytree(llama, tmp_path / "model")
    index, shard, keys = _break(str(folder), case)
    want = _message(index, shard, keys, case)
    capsys.readouterr()
    rc = ptdstream.hf.main(["export", "executorch", "-m", str(folder), "--task", "text-generation", "--recipe",
                            "portable", "--max_seq_len", "16", "-o", str(tmp_path / "out"), "--weightless"])
    err = capsys.readouterr().err
    assert (rc, [line for line in err.splitlines() if line.startswith("ptdstream.hf")]) == (
        1, [f"ptdstream.hf: error: {want}"])
    assert "Traceback" not in err
    with pytest.raises(ptdstream.CheckpointFileError) as raised:
        ptdstream.hf.export(str(folder), str(tmp_path / "out"), task="text-generation", recipe="portable",
                            max_seq_len=16, weightless=True)
    assert str(raised.value) == want
    assert not (tmp_path / "out").exists()
