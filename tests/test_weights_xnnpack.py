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
    with pytest.raises(CheckpointMismatchError, match="for XNNPACK: like= the old .ptd files and old_checkpoint="):
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
        "(quantized, 4-bit packed, NHWC or swapped conv weight, cast to fp32); re-export",
        "extra: 1 checkpoint key(s) are not weights of the program: 'conv.weight' "
        "(allow_extra=True / --allow-extra to ignore them)",
    ]


def _raw_bytes(t) -> bytes:
    return t.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
