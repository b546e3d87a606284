"""write_ptd for XNNPACK programs with tagged external weights: untransformed
weights give the re-export's .pte and .ptd (also through key_map); packed or
transformed ones are refused by key."""

from __future__ import annotations

import hashlib
import os
import warnings

import pytest
import torch
from _checkpoints import save_checkpoint, state_of
from conftest import Mlp, reference_files

from ptdstream.errors import CheckpointMismatchError
from ptdstream.weights import DEFAULT_TAG, write_ptd

warnings.filterwarnings("ignore")
PTD = DEFAULT_TAG + ".ptd"


@pytest.mark.slow
def test_xnnpack_tagged_weights_are_refused_by_key(tmp_path):
    """XNNPACK 1.5.1 with tagged external weights names each packed weight by the
    SHA-256 of its bytes (fp32 linear weights: untransformed); write_ptd refuses
    them, naming the delegate and each key."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

    torch.manual_seed(0)
    model = Mlp().eval()
    x = (torch.randn(2, 64),)
    module = torch.export.export(model, x).module()
    delegate_external_constants_pass_unlifted(module, lambda node: "model")
    edge = to_edge_transform_and_lower(torch.export.export(module, x), partitioner=[XnnpackPartitioner()])
    manager = edge.to_executorch()
    reference_files(manager, str(tmp_path / "A"))
    from ptdstream.format.reader import read_artifact

    keys = [e.key for e in read_artifact(str(tmp_path / "A" / "model.ptd")).named]
    expected = {hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()
                for t in model.state_dict().values()}
    assert set(keys) == expected  # every key is the SHA-256 of the untransformed fp32 bytes
    ckpt = save_checkpoint("safetensors", state_of(model), tmp_path / "ckpt")
    with pytest.raises(CheckpointMismatchError) as info:
        write_ptd(str(tmp_path / "A" / "model.pte"), ckpt, str(tmp_path), like=[str(tmp_path / "A" / "model.ptd")],
                  allow_extra=True)
    problems = info.value.problems
    assert problems[0].startswith("delegate: method 'forward' holds a XnnpackBackend delegate")
    assert [p.split("'")[1] for p in problems[1:]] == keys
    assert all("named data of a delegate or backend" in p for p in problems[1:])



class EmbedMlp(torch.nn.Module):
    """An embedding (left to the portable ops: an FQN constant) and two linears
    (XNNPACK: fp32 weights stored untransformed)."""

    def __init__(self) -> None:
        super().__init__()
        self.e = torch.nn.Embedding(16, 64)
        self.l1 = torch.nn.Linear(64, 32)
        self.l2 = torch.nn.Linear(32, 8)

    def forward(self, tokens):
        return self.l2(torch.relu(self.l1(self.e(tokens))))


def _export_xnnpack_tagged(model, inputs, folder):
    """XNNPACK with its weights tagged 'model', other constants external: model.pte,
    model.ptd (XNNPACK's SHA-256 keys), _default_external_constant.ptd (FQNs)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

    module = torch.export.export(model.eval(), inputs).module()
    delegate_external_constants_pass_unlifted(module, lambda node: "model")
    edge = to_edge_transform_and_lower(torch.export.export(module, inputs), partitioner=[XnnpackPartitioner()])
    return reference_files(edge.to_executorch(ExecutorchBackendConfig(external_constants=True)), str(folder))


@pytest.mark.slow
def test_xnnpack_untransformed_weights_give_the_reexport_pte_and_ptd(tmp_path):
    inputs = (torch.randint(0, 16, (2, 3)),)
    torch.manual_seed(0)
    model_a = EmbedMlp()
    torch.manual_seed(1)
    model_b = EmbedMlp()
    files_a = _export_xnnpack_tagged(model_a, inputs, tmp_path / "A")
    files_b = _export_xnnpack_tagged(model_b, inputs, tmp_path / "B")
    assert sorted(files_b) == [PTD, "model.ptd", "model.pte"] and files_a["model.pte"] != files_b["model.pte"]
    old = save_checkpoint("safetensors", state_of(model_a), tmp_path / "old")
    new = save_checkpoint("safetensors", state_of(model_b), tmp_path / "new")
    out = tmp_path / "out"
    out.mkdir()
    like = [str(tmp_path / "A" / PTD), str(tmp_path / "A" / "model.ptd")]
    write_ptd(str(tmp_path / "A" / "model.pte"), new, str(out), like=like, old_checkpoint=old)
    assert sorted(os.listdir(out)) == sorted(files_b)
    for name, data in files_b.items():
        assert (out / name).read_bytes() == data, name
    # Without the old weights: refused, naming the XNNPACK keys.
    with pytest.raises(CheckpointMismatchError,
                       match="for XNNPACK: like= / --like the old .ptd files and old_checkpoint= / --old "):
        write_ptd(str(tmp_path / "A" / "model.pte"), new, str(out), like=like)
    # New weights under another prefix, old ones under the program's FQNs: key_map serves both.
    prefixed = save_checkpoint("safetensors", {f"model.{k}": v for k, v in state_of(model_b).items()},
                                tmp_path / "prefixed")
    out_map = tmp_path / "out_map"
    out_map.mkdir()
    write_ptd(str(tmp_path / "A" / "model.pte"), prefixed, str(out_map), like=like, old_checkpoint=old,
              key_map={"": "model."})
    for name, data in files_b.items():
        assert (out_map / name).read_bytes() == data, name
    with pytest.raises(CheckpointMismatchError) as info:
        write_ptd(str(tmp_path / "A" / "model.pte"), prefixed, str(out_map), like=like, old_checkpoint=old)
    assert any(p.startswith("XNNPACK key ") and p.endswith(f"is not in {prefixed}") for p in info.value.problems)


@pytest.mark.slow
def test_xnnpack_transformed_weights_are_refused_by_key(tmp_path):
    """A conv weight goes to XNNPACK in NHWC: its key is the SHA-256 of bytes no
    checkpoint tensor has, so it is refused by name (the bias is untransformed)."""

    class Conv(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return self.conv(x)

    inputs = (torch.randn(1, 3, 8, 8),)
    torch.manual_seed(0)
    model_a = Conv()
    files = _export_xnnpack_tagged(model_a, inputs, tmp_path / "A")
    from ptdstream.format.reader import read_artifact

    keys = [e.key for e in read_artifact(str(tmp_path / "A" / "model.ptd")).named]
    old = save_checkpoint("safetensors", state_of(model_a), tmp_path / "old")
    torch.manual_seed(1)
    new = save_checkpoint("safetensors", state_of(Conv()), tmp_path / "new")
    like = [str(tmp_path / "A" / n) for n in sorted(files) if n.endswith(".ptd")]
    with pytest.raises(CheckpointMismatchError) as info:
        write_ptd(str(tmp_path / "A" / "model.pte"), new, str(tmp_path), like=like, old_checkpoint=old)
    bias_key = hashlib.sha256(_raw_bytes(model_a.conv.bias)).hexdigest()
    transformed = [k for k in keys if k != bias_key]
    assert len(transformed) == 1
    assert info.value.problems == [
        f"XNNPACK key {transformed[0]!r}: no tensor of {old} has these bytes: XNNPACK transformed them "
        "(quantized, 4-bit packed, NHWC or swapped conv weight, cast to fp32); re-export (or, for a constant "
        f"that is no trained weight, such as a non-persistent buffer: keep=[{transformed[0]!r}] / --keep "
        f"{transformed[0]} keeps its exported bytes)",
        "extra: 1 checkpoint key(s) are not weights of the program: 'conv.weight' "
        "(allow_extra=True / --allow-extra to ignore them)",
    ]


def _raw_bytes(t) -> bytes:
    return t.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()


@pytest.fixture(scope="module")
def demo_exports(tmp_path_factory):
    """The demo's two-method XNNPACK program (a smaller TinyLM: one layer, dim 32),
    exported with its weights (``old/``) and re-exported with every parameter
    moved by 0.01 (``ref/``), and both weights saved as a Hugging Face checkpoint
    is (``save_model``: the tied embedding once, no non-persistent causal mask)."""
    from safetensors.torch import save_model

    import ptdstream
    from ptdstream.demo import run as demo
    from ptdstream.demo.model import TinyLMConfig, build_tiny_lm

    root = tmp_path_factory.mktemp("demo-weights")
    model = build_tiny_lm(TinyLMConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_seq_len=16))

    def export_into(folder: str) -> None:
        os.makedirs(root / folder)
        manager = demo.lower(demo.export_programs(model)).to_executorch(demo.backend_config())
        ptdstream.save(manager, str(root / folder / "model.pte"))

    export_into("old")
    save_model(model, str(root / "old.safetensors"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    export_into("ref")
    save_model(model, str(root / "new.safetensors"))
    return root


MASK = "layers.0.causal_mask"


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_a_weight_shared_by_two_methods_gives_the_reexport(demo_exports, tmp_path):
    """Each XNNPACK key is named by both methods' delegate blobs: it is matched once
    and replaced in both; the causal mask no checkpoint saves is kept from the old
    .ptd: the .pte and .ptd are the re-export's bytes."""
    root = demo_exports
    old_pte = (root / "old" / "model.pte").read_bytes()
    xnn_keys = [e.key for e in __import__("ptdstream.format.reader", fromlist=["x"]).read_artifact(
        str(root / "old" / "model.ptd")).named if len(e.key) == 64]
    assert xnn_keys and all(old_pte.count(k.encode()) == 2 for k in xnn_keys)  # once per method
    report = write_ptd(str(root / "old" / "model.pte"), str(root / "new.safetensors"), str(tmp_path),
                       like=[str(root / "old" / "model.ptd")], old_checkpoint=str(root / "old.safetensors"),
                       keep=[MASK])
    assert _files(tmp_path) == _files(root / "ref")
    assert report.files[-1].path == str(tmp_path / "model.pte")


@pytest.mark.slow
def test_the_cli_keeps_a_buffer_and_maps_a_tied_weight(demo_exports, tmp_path):
    """A checkpoint naming the tied embedding by its other name: --map names it,
    --keep keeps the mask; the re-export's bytes."""
    from safetensors.torch import load_file, save_file

    from ptdstream.cli import main

    root = demo_exports
    state = load_file(str(root / "new.safetensors"))
    state["tok_embeddings.weight"] = state.pop("output.weight")
    save_file(state, str(tmp_path / "renamed.safetensors"))
    out = tmp_path / "out"
    out.mkdir()
    assert main(["weights", str(root / "old" / "model.pte"), "--from", str(tmp_path / "renamed.safetensors"),
                 "--old", str(root / "old.safetensors"), "--like", str(root / "old" / "model.ptd"),
                 "-o", str(out), "--keep", MASK, "--map", "output.weight=tok_embeddings.weight"]) == 0
    assert _files(out) == _files(root / "ref")


@pytest.mark.slow
def test_a_missing_buffer_and_a_renamed_tied_weight_name_their_options(demo_exports, tmp_path):
    from safetensors.torch import load_file, save_file

    root = demo_exports
    state = load_file(str(root / "new.safetensors"))
    state["tok_embeddings.weight"] = state.pop("output.weight")
    ckpt = str(tmp_path / "renamed.safetensors")
    save_file(state, ckpt)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.ptd").write_bytes(b"previous")
    like = str(root / "old" / "model.ptd")
    with pytest.raises(CheckpointMismatchError) as info:
        write_ptd(str(root / "old" / "model.pte"), ckpt, str(out), like=[like],
                  old_checkpoint=str(root / "old.safetensors"), keep=["nope"])
    problems = info.value.problems
    assert "keep: 'nope' is in none of the like= files" in problems
    assert (f"missing: '{MASK}' (FLOAT[16, 16] dim order [0, 1]) is not in {ckpt}; {like} holds it (a buffer no "
            f"checkpoint saves, such as a non-persistent one?): keep=['{MASK}'] / --keep {MASK} copies its "
            "exported bytes unchanged") in problems
    assert (f"missing: 'output.weight' (FLOAT[64, 32] dim order [0, 1]) is not in {ckpt}; its checkpoint key "
            "'tok_embeddings.weight' has its dtype and shape (a tied weight saved under its other name?): "
            "key_map={'output.weight': 'tok_embeddings.weight'} / --map output.weight=tok_embeddings.weight"
            ) in problems
    assert not any("appears" in p for p in problems)
    assert _files(out) == {"model.ptd": b"previous"}
